"""Gateway configuration: a frozen dataclass loaded by `services.config.load_config`.

Every field becomes a `--flag-name` option with a `MESHSERVE_FLAG_NAME` env default,
e.g. `--tokenizer-address` / `MESHSERVE_TOKENIZER_ADDRESS`, `--api-keys k1,k2`.
"""

from __future__ import annotations

import dataclasses
import math

from services.config import MAX_MESSAGE_BYTES


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """OpenAI-compatible HTTP gateway in front of the tokenizer and scheduler services."""

    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer_address: str = "127.0.0.1:50051"
    # One scheduler, or several replicas ("host:port,host:port"): a route goes to any
    # live one, so a replica's death costs no request.
    scheduler_address: str = "127.0.0.1:50052"
    # Accepted `Authorization: Bearer <key>` values; empty = no authentication.
    api_keys: tuple[str, ...] = ()
    max_request_bytes: int = 16 * 1024 * 1024
    # Deadline of every upstream call, the whole generation stream included.
    request_timeout_s: float = 600.0
    log_level: str = "INFO"
    # One log line per HTTP request (uvicorn's access log). Off by default: it is written
    # as the response starts, i.e. before a stream's first token, and costs the gateway
    # ~60 us per request; per-route counts and latencies are in the metrics.
    access_log: bool = False
    tracing: str = "none"
    otlp_endpoint: str = ""
    # max_tokens when the client omits it (capped by the model's remaining context).
    default_max_tokens: int = 256
    max_n: int = 16
    # Requests per second allowed per API key (token bucket); 0 = no rate limit.
    rate_limit_rps_per_key: float = 0.0
    # Bucket size; 0 = max(1, rate_limit_rps_per_key).
    rate_limit_burst: int = 0
    # On SIGTERM: answer new requests 503 and let requests in flight finish this long.
    drain_timeout_s: float = 30.0
    # How long /v1/models (and the model check of every request) reuses ListWorkers.
    models_cache_s: float = 1.0
    # How long an idle HTTP keep-alive connection stays open. Longer than the idle timeouts
    # of the clients and load balancers in front (aiohttp's pool 15 s, AWS ALB 60 s): when
    # the server closes first, a client may send its next request on the closing
    # connection, and a POST is not retried (uvicorn's own default, 5 s, did so to a
    # benchmark's aiohttp client). nginx's default, 75 s.
    keep_alive_timeout_s: int = 75
    max_grpc_message_bytes: int = MAX_MESSAGE_BYTES
    # Routing again after a worker failed before the first token (excluding it).
    max_retries: int = 2
    # Mid-stream migrations per request: a worker lost after tokens were streamed is
    # replaced by another one that continues from the prompt plus the tokens so far
    # (0 = the request ends with an error instead).
    max_migrations: int = 3
    # Where tokenizer files fetched from the tokenizer service are kept (empty = a
    # directory under the system temp dir).
    tokenizer_cache_dir: str = ""
    # Tool-call output format: one parser for every model ("hermes", "qwen",
    # "llama3_json", "mistral") or per model ("model-a=mistral,model-b=hermes";
    # a bare name is the default). See gateway/tool_parsers.
    tool_call_parser: str = "hermes"
    # `<think>` reasoning split into reasoning_content: "", "qwen3" or "deepseek_r1".
    reasoning_parser: str = ""
    # Shared state of the gateway replicas: stored /v1/responses and their conversations
    # (gateway/response_store.py). Empty = a bounded in-process store, and
    # previous_response_id is refused (another replica could not continue it).
    redis_url: str = ""
    # How long a stored /v1/responses response (and its conversation) is kept.
    response_ttl_s: int = 30 * 24 * 3600

    def __post_init__(self) -> None:
        """Rejects values that cannot work, naming the offending option."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_request_bytes <= 0:
            raise ValueError("max_request_bytes must be > 0")
        if not (self.request_timeout_s > 0 and math.isfinite(self.request_timeout_s)):
            raise ValueError("request_timeout_s must be a positive number")
        if self.tracing not in ("none", "console", "otlp", "memory"):
            raise ValueError("tracing must be one of none, console, otlp, memory")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")
        if self.rate_limit_rps_per_key < 0 or self.rate_limit_burst < 0:
            raise ValueError("rate_limit_rps_per_key and rate_limit_burst must be >= 0")
        if self.drain_timeout_s < 0 or self.models_cache_s < 0:
            raise ValueError("drain_timeout_s and models_cache_s must be >= 0")
        if self.response_ttl_s < 1:
            raise ValueError("response_ttl_s must be >= 1")
        if self.keep_alive_timeout_s < 1:
            raise ValueError("keep_alive_timeout_s must be >= 1")
        if self.max_retries < 0 or self.max_migrations < 0:
            raise ValueError("max_retries and max_migrations must be >= 0")
        if not [a for a in self.scheduler_address.split(",") if a.strip()]:
            raise ValueError("scheduler_address must name at least one scheduler")
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not contain empty keys")
        from gateway import reasoning, tool_parsers  # here: config must not import them eagerly

        tool_parsers.check_spec(self.tool_call_parser)
        reasoning.check_name(self.reasoning_parser)
