"""routing_bench's measurements and what is made of them: one request's Record, the
scheduler's /metrics (histograms, routing reasons), a run's summary (TTFT, throughput, the
workers' queue balance, predicted vs actual cached tokens, the ideal hit rate, an open
loop's offered vs achieved load), and the medians over repeats with the prefix policy's
comparison against the others."""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.routing_workload import BenchConfig, OpenLoop, zero_latency_request_rate
from services.kv_hash import block_hashes


@dataclass
class Record:
    """One request's measurements."""

    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    # Client-side latency of a route on the RouteStream.
    route_s: float
    worker_id: str
    started: float = 0.0
    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()
    predicted_cached_tokens: int = 0


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def scrape(metrics_port: int) -> str:
    """The scheduler's /metrics text ("" when unreachable)."""
    try:
        return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""


def routing_reasons(text: str) -> dict[str, float]:
    """meshserve_scheduler_routed_total by reason."""
    reasons: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshserve_scheduler_routed_total":
                reason = sample.labels["reason"]
                reasons[reason] = reasons.get(reason, 0.0) + sample.value
    return reasons


@dataclass
class HistogramSnapshot:
    """Cumulative bucket counts (by upper bound), sum and count of one histogram."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0

    @classmethod
    def parse(cls, text: str, name: str) -> HistogramSnapshot:
        snapshot = cls()
        for family in text_string_to_metric_families(text):
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name == name + "_bucket":
                    snapshot.buckets[float(sample.labels["le"])] = sample.value
                elif sample.name == name + "_sum":
                    snapshot.sum = sample.value
                elif sample.name == name + "_count":
                    snapshot.count = sample.value
        return snapshot

    def minus(self, before: HistogramSnapshot) -> HistogramSnapshot:
        """The observations made between `before` and this snapshot."""
        return HistogramSnapshot(
            {le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.sum - before.sum,
            self.count - before.count,
        )

    def quantile(self, q: float) -> float:
        """Prometheus' histogram_quantile: linear interpolation inside the bucket."""
        if self.count <= 0 or not self.buckets:
            return float("nan")
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le, cumulative in sorted(self.buckets.items()):
            if cumulative >= rank:
                if le == float("inf"):
                    return lower_bound  # above the highest finite bucket
                inside = cumulative - lower_count
                fraction = (rank - lower_count) / inside if inside > 0 else 1.0
                return lower_bound + (le - lower_bound) * fraction
            lower_bound, lower_count = le, cumulative
        return lower_bound

    def summary_ms(self) -> dict[str, float]:
        mean = self.sum / self.count if self.count > 0 else float("nan")
        return {
            "p50": self.quantile(0.5) * 1000,
            "p99": self.quantile(0.99) * 1000,
            "mean": mean * 1000,
            "count": self.count,
        }


def ideal_hit_rate(records: list[Record], capacity_blocks: int, block_size: int) -> float:
    """The hit rate of ONE worker holding `capacity_blocks` (all workers' memory) on the
    same request sequence: an LRU of block hashes, hits capped like the block manager
    ((prompt - 1) // block_size full blocks), prompt + output blocks stored after each."""
    lru: OrderedDict[int, None] = OrderedDict()
    cached = prompt = 0
    for record in sorted(records, key=lambda r: r.started):
        hashes = block_hashes(record.prompt, block_size)
        limit = (len(record.prompt) - 1) // block_size
        hit = 0
        while hit < min(limit, len(hashes)) and hashes[hit] in lru:
            hit += 1
        cached += hit * block_size
        prompt += len(record.prompt)
        for block in block_hashes(record.prompt + record.output, block_size):
            lru[block] = None
            lru.move_to_end(block)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return cached / prompt if prompt else 0.0


def ttft_by_hit(records: list[Record]) -> dict[str, float]:
    """TTFT p50 (ms) of requests mostly served from the prefix cache vs mostly not."""
    hit = [r.ttft_s * 1000 for r in records if r.prompt_tokens and r.cached_tokens / r.prompt_tokens >= 0.5]
    miss = [r.ttft_s * 1000 for r in records if r.prompt_tokens and r.cached_tokens / r.prompt_tokens < 0.5]
    return {"hit_ge_50pct_p50": percentile(hit, 50), "hit_lt_50pct_p50": percentile(miss, 50),
            "hit_ge_50pct_requests": len(hit), "hit_lt_50pct_requests": len(miss)}  # fmt: skip


def summarize(
    records: list[Record], wall_s: float, workers: list[Any], overhead: HistogramSnapshot
) -> dict[str, Any]:
    ttft = [r.ttft_s * 1000 for r in records]
    latency = [r.latency_s * 1000 for r in records]
    route = [r.route_s * 1000 for r in records]
    prompt = sum(r.prompt_tokens for r in records)
    per_worker: dict[str, int] = {}
    for r in records:
        per_worker[r.worker_id] = per_worker.get(r.worker_id, 0) + 1
    return {
        "requests": len(records),
        "prefix_hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
        "worker_prefix_hit_rate": {
            s.worker.worker_id: round(s.load.prefix_cache_hit_rate, 4) for s in workers
        },
        "requests_per_worker": per_worker,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "mean": statistics.fmean(ttft)},
        "ttft_by_cache_hit": ttft_by_hit(records),
        "latency_ms": {"p50": percentile(latency, 50), "p99": percentile(latency, 99)},
        "route_ms": {
            "p50": percentile(route, 50),
            "p99": percentile(route, 99),
            "mean": statistics.fmean(route),
        },
        "scheduler_overhead_ms": overhead.summary_ms(),
        "request_throughput": len(records) / wall_s,
        "output_throughput": sum(r.output_tokens for r in records) / wall_s,
        "prompt_tokens": prompt,
        "wall_s": wall_s,
    }


def queue_balance(samples: dict[str, list[int]]) -> dict[str, Any]:
    """Time-averaged queue per worker; the busiest one over the mean of all."""
    means = {w: statistics.fmean(q) for w, q in samples.items() if q}
    overall = statistics.fmean(means.values()) if means else 0.0
    busiest = max(means.values()) if means else 0.0
    return {"mean_queue_per_worker": {w: round(m, 2) for w, m in means.items()},
            "busiest_over_mean": busiest / overall if overall else float("nan")}  # fmt: skip


def prediction_error(records: list[Record]) -> dict[str, float]:
    """Predicted (index at routing time) vs actual (worker usage) cached tokens."""
    errors = [r.cached_tokens - r.predicted_cached_tokens for r in records]
    predicted = sum(r.predicted_cached_tokens for r in records)
    actual = sum(r.cached_tokens for r in records)
    return {"predicted_tokens": predicted, "actual_tokens": actual,
            "exact_share": sum(e == 0 for e in errors) / len(errors) if errors else float("nan"),
            "over_predicted_share": sum(e < 0 for e in errors) / len(errors) if errors else float("nan")}  # fmt: skip


def open_loop_summary(
    config: BenchConfig, loop: OpenLoop, records: list[Record], wall_s: float,
    timeline: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """Offered vs achieved load and the client-side queue of an open-loop run."""
    span = loop.arrivals[-1] if loop.arrivals else 0.0
    done_in_span = sum(r.started + r.latency_s - loop.start <= span for r in records)
    in_flight = [row["client_in_flight"] for row in timeline] or [0]
    live = [row["live_sessions"] for row in timeline] or [0]
    return {
        "offered_session_rate": config.session_rate,
        "offered_request_rate": config.session_rate * config.turns,
        "sessions": len(loop.arrivals),
        "arrival_span_s": span,
        "achieved_request_rate": len(records) / wall_s if wall_s else float("nan"),
        "zero_latency_request_rate": zero_latency_request_rate(config, len(loop.arrivals)),
        "request_rate_during_arrivals": done_in_span / span if span else float("nan"),
        "drain_s": wall_s - span,
        "failed_requests": loop.failed,
        "client_in_flight": {"mean": statistics.fmean(in_flight), "max": max(in_flight)},
        "live_sessions": {"mean": statistics.fmean(live), "max": max(live)},
    }


MEDIAN_KEYS = (
    ("prefix_hit_rate",),
    ("ideal_hit_rate",),
    ("policy_ms", "p50"),
    ("policy_ms", "p99"),
    ("route_probe_ms", "p50"),
    ("route_probe_ms", "p99"),
    ("route_probe_overhead_ms", "p99"),
    ("queues", "busiest_over_mean"),
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("latency_ms", "p50"),
    ("route_ms", "p50"),
    ("route_ms", "p99"),
    ("scheduler_overhead_ms", "p50"),
    ("scheduler_overhead_ms", "p99"),
    ("scheduler_overhead_ms", "mean"),
    ("request_throughput",),
    ("output_throughput",),
    # Open loop only (skipped for closed-loop runs).
    ("open_loop", "offered_request_rate"),
    ("open_loop", "achieved_request_rate"),
    ("open_loop", "zero_latency_request_rate"),
    ("open_loop", "request_rate_during_arrivals"),
    ("open_loop", "drain_s"),
    ("open_loop", "failed_requests"),
    ("open_loop", "client_in_flight", "mean"),
    ("open_loop", "client_in_flight", "max"),
    ("open_loop", "live_sessions", "mean"),
)


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median over repeated runs of the headline metrics, keyed like "ttft_ms.p50"
    (a metric missing from a run, e.g. open-loop figures of a closed loop, is left out)."""
    result: dict[str, float] = {}
    for path in MEDIAN_KEYS:
        values = []
        for run in runs:
            value: Any = run
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                values.append(float(value))
        if values and len(values) == len(runs):
            result[".".join(path)] = statistics.median(values)
    return result


def comparison(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prefix-aware against the others (medians) and the issue's targets."""
    if "prefix" not in results or "round_robin" not in results:
        return {}
    p, rr = results["prefix"]["median"], results["round_robin"]["median"]
    report: dict[str, Any] = {
        "hit_rate_prefix_over_ideal": p["prefix_hit_rate"] / p["ideal_hit_rate"],
        "hit_rate_round_robin_over_ideal": rr["prefix_hit_rate"] / p["ideal_hit_rate"],
        "ttft_p50_speedup_prefix_vs_round_robin": rr["ttft_ms.p50"] / p["ttft_ms.p50"],
        "ttft_p99_speedup_prefix_vs_round_robin": rr["ttft_ms.p99"] / p["ttft_ms.p99"],
        "throughput_ratio_prefix_over_round_robin": p["output_throughput"] / rr["output_throughput"],
    }
    if "least_load" in results:
        ll = results["least_load"]["median"]
        report["throughput_ratio_prefix_over_least_load"] = p["output_throughput"] / ll["output_throughput"]
        report["ttft_p50_speedup_prefix_vs_least_load"] = ll["ttft_ms.p50"] / p["ttft_ms.p50"]
    report["targets"] = {
        "hit_rate_ge_90pct_of_ideal": report["hit_rate_prefix_over_ideal"] >= 0.9,
        "ttft_p50_ge_2x_round_robin": report["ttft_p50_speedup_prefix_vs_round_robin"] >= 2.0,
        "throughput_ge_1_3x_round_robin": report["throughput_ratio_prefix_over_round_robin"] >= 1.3,
        "busiest_queue_within_2x_mean": p["queues.busiest_over_mean"] <= 2.0,
        "throughput_ge_least_load": report.get("throughput_ratio_prefix_over_least_load", 0.0) >= 1.0,
        "policy_p99_lt_2ms": p["policy_ms.p99"] < 2.0,
        "route_end_to_end_p99_lt_2ms": p["route_probe_ms.p99"] < 2.0,
    }
    return report
