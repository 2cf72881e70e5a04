"""Prometheus metrics of the gateway process, exposed on its own `GET /metrics`.

Latency histograms follow vLLM's definitions: TTFT is request arrival → first
generated text; TPOT is (e2e − TTFT) / (completion tokens − 1) per request; the
inter-token latency is the gap between consecutive output events divided by the
tokens they carried.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)

REQUESTS = Counter(
    "meshserve_gateway_requests_total",
    "HTTP requests answered, by route and status code",
    ["route", "status"],
)
IN_FLIGHT = Gauge(
    "meshserve_gateway_requests_in_flight",
    "HTTP requests being served (streams included until their last byte)",
    ["route"],
)
E2E_LATENCY = Histogram(
    "meshserve_gateway_request_duration_seconds",
    "End-to-end HTTP request latency (whole stream for streamed responses)",
    ["route"],
    buckets=_LATENCY_BUCKETS,
)
TTFT = Histogram(
    "meshserve_gateway_time_to_first_token_seconds",
    "Request arrival to first generated output",
    ["route"],
    buckets=_LATENCY_BUCKETS,
)
TPOT = Histogram(
    "meshserve_gateway_time_per_output_token_seconds",
    "Mean time per output token after the first, per request",
    ["route"],
    buckets=_TOKEN_BUCKETS,
)
ITL = Histogram(
    "meshserve_gateway_inter_token_latency_seconds",
    "Gap between consecutive output events divided by their tokens",
    ["route"],
    buckets=_TOKEN_BUCKETS,
)
PROMPT_TOKENS = Counter(
    "meshserve_gateway_prompt_tokens_total", "Prompt tokens of finished requests", ["route"]
)
COMPLETION_TOKENS = Counter(
    "meshserve_gateway_completion_tokens_total", "Completion tokens of finished requests", ["route"]
)
ADMISSIONS = Counter(
    "meshserve_gateway_admissions_total",
    "Generation requests by tenant, priority class and outcome: admitted (routed to a worker), "
    "budget_tokens, budget_requests, budget_too_large (429 by the tenant's budget) or overloaded "
    "(429 from the scheduler: queue full, queue timeout, or shed)",
    ["tenant", "class", "outcome"],
)
QUEUED = Histogram(
    "meshserve_gateway_queued_seconds",
    "Time from a route's request to its lease (the scheduler's admission queue and routing), "
    "by tenant and priority class",
    ["tenant", "class"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TENANT_TOKENS = Counter(
    "meshserve_gateway_tenant_tokens_total",
    "Tokens (prompt + completion) of ended generation requests, by tenant and priority class",
    ["tenant", "class"],
)
BACKGROUND = Counter(
    "meshserve_gateway_background_responses_total",
    "Background responses by what happened to them on this replica: launched, adopted (its "
    "producing replica died), cancelled, failed",
    ["event"],
)
JSON_MODE_VIOLATIONS = Counter(
    "meshserve_gateway_json_mode_violations_total",
    "Choices of response_format=json_object requests whose text is not valid JSON",
)


REROUTES = Counter(
    "meshserve_gateway_reroutes_total",
    "Requests routed again before their first token, by reason: worker_failed (stream lost or "
    "UNAVAILABLE, the worker excluded) or reencode (image embeddings evicted)",
    ["reason"],
)
MIGRATIONS = Counter(
    "meshserve_gateway_migrations_total",
    "Requests whose worker was lost after tokens arrived, by outcome: migrated (continued on "
    "another worker from the prompt plus the output so far), limit_reached (ended with an "
    "error, max_migrations reached), or moved (no failure: a P/D prefill worker handed its "
    "stream to a decoder before a long prefill, continued likewise)",
    ["outcome"],
)
WORKER_STREAMS = Counter(
    "meshserve_gateway_worker_streams_opened_total",
    "Worker.GenerateStream calls opened to workers (one per worker, again after a break)",
)


class GenerationTimer:
    """Records TTFT, inter-token latency, TPOT and token counts of one request."""

    def __init__(self, route: str, start: float) -> None:
        self.route = route
        self.start = start
        self.first: float | None = None
        self.last = start
        # The labelled child, looked up once: `labels()` per token is measurable CPU.
        self._itl = ITL.labels(route)

    def on_output(self, num_tokens: int) -> None:
        """Called for every output event carrying `num_tokens` new tokens."""
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            TTFT.labels(self.route).observe(now - self.start)
        else:
            self._itl.observe((now - self.last) / num_tokens)
        self.last = now

    def finish(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Called once when the request completed successfully."""
        PROMPT_TOKENS.labels(self.route).inc(prompt_tokens)
        COMPLETION_TOKENS.labels(self.route).inc(completion_tokens)
        if self.first is not None and completion_tokens > 1:
            TPOT.labels(self.route).observe((self.last - self.first) / (completion_tokens - 1))
