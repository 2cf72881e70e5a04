"""Gateway configuration: a frozen dataclass loaded by `services.config.load_config`.

Every field becomes a `--flag-name` option with a `MESHSERVE_FLAG_NAME` env default,
e.g. `--tokenizer-address` / `MESHSERVE_TOKENIZER_ADDRESS`, `--api-keys k1,k2`.
"""

from __future__ import annotations

import dataclasses
import math

from services.config import DEFAULT_PORTS, MAX_MESSAGE_BYTES, ProcessConfig, at_least, opt, positive


@dataclasses.dataclass(frozen=True)
class GatewayConfig(ProcessConfig):
    """OpenAI-compatible HTTP gateway in front of the tokenizer and scheduler services."""

    port: int = opt(DEFAULT_PORTS["gateway"], "the HTTP port (the API and /metrics)")
    reuse_port: bool = opt(
        False,
        "bind the port with SO_REUSEPORT, beside other gateway replicas on it (the kernel spreads "
        "connections over them; the launcher's --num-gateways)",
    )
    tokenizer_address: str = opt(
        f"127.0.0.1:{DEFAULT_PORTS['tokenizer']}", "the tokenizer service, host:port"
    )
    scheduler_address: str = opt(
        f"127.0.0.1:{DEFAULT_PORTS['scheduler']}",
        "one scheduler, or several replicas host:port,host:port (a route goes to any live one, "
        "so a replica's death costs no request)",
    )
    api_keys: tuple[str, ...] = opt(
        (), "accepted `Authorization: Bearer <key>` values; empty: no authentication"
    )
    admin_api_keys: tuple[str, ...] = opt(
        (), "keys that may also call admin endpoints (LoRA load/unload); they are valid API keys"
    )
    enable_lora_updating: bool = opt(
        False,
        "declare POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); the workers need --enable-runtime-lora-updating",
    )
    max_request_bytes: int = opt(16 * 1024 * 1024, "the largest HTTP request body accepted")
    request_timeout_s: float = opt(
        600.0, "deadline of every upstream call, the whole generation stream included"
    )
    access_log: bool = opt(
        False,
        "one log line per HTTP request (uvicorn's access log); off by default: it is written as "
        "the response starts, i.e. before a stream's first token, and costs ~60 us per request; "
        "per-route counts and latencies are in the metrics",
    )
    default_max_tokens: int = opt(
        256, "max_tokens when the client omits it (capped by the model's remaining context)"
    )
    max_n: int = opt(16, "the largest `n` (choices per request) accepted")
    rate_limit_rps_per_key: float = opt(
        0.0, "requests per second allowed per API key (token bucket); 0: no limit"
    )
    rate_limit_burst: int = opt(0, "the rate limit's bucket size; 0: max(1, rate_limit_rps_per_key)")
    tokens_per_minute_per_key: int = opt(
        0,
        "token budget of each API key (or of all anonymous callers together): prompt plus "
        "n × max_tokens reserved when a request is admitted, the unused part given back at its "
        "end; shared by the replicas through --redis-url (gateway/budgets.py); 0: none",
    )
    requests_per_minute_per_key: int = opt(0, "request budget of each API key, likewise; 0: none")
    key_budgets: tuple[str, ...] = opt(
        (), "budgets of particular keys, KEY=TOKENS/REQUESTS per minute (0: unlimited), over the defaults"
    )
    classes: tuple[str, ...] = opt(
        ("interactive=-10", "default=0", "batch=10", "sheddable=20/0"),
        "priority classes a request names in service_tier, NAME=PRIORITY[/QUEUE_TIMEOUT_S]: vLLM "
        "priority (lower first), longest wait in the scheduler's queue (none: its "
        "--queue-timeout-s; 0: never queued, refused with 429 when no worker is free); "
        "gateway/classes.py",
    )
    key_classes: tuple[str, ...] = opt(
        (), "the class of particular keys, KEY=CLASS: their requests' class and the soonest they may ask for"
    )
    models_cache_s: float = opt(
        1.0, "how long /v1/models (and the model check of every request) reuses ListWorkers"
    )
    keep_alive_timeout_s: int = opt(
        75,
        "how long an idle HTTP keep-alive connection stays open: longer than the idle timeouts of "
        "the clients and load balancers in front (aiohttp's pool 15 s, AWS ALB 60 s), since a POST "
        "sent on a connection the server is closing is not retried; nginx's default",
    )
    max_grpc_message_bytes: int = opt(MAX_MESSAGE_BYTES, "the largest gRPC message sent or accepted upstream")
    max_retries: int = opt(2, "routing again after a worker failed before the first token (excluding it)")
    max_migrations: int = opt(
        3,
        "mid-stream migrations per request: a worker lost after tokens were streamed is replaced "
        "by another that continues from the prompt plus the tokens so far (0: the request ends "
        "with an error instead)",
    )
    tokenizer_cache_dir: str = opt(
        "", "where tokenizer files fetched from the tokenizer service are kept (empty: under the temp dir)"
    )
    tool_call_parser: str = opt(
        "hermes",
        "tool-call output format: one parser for every model (hermes, qwen, llama3_json, mistral) "
        "or per model (model-a=mistral,model-b=hermes; a bare name is the default); gateway/tool_parsers",
    )
    reasoning_parser: str = opt(
        "", "`<think>` reasoning split into reasoning_content: empty, qwen3 or deepseek_r1"
    )
    redis_url: str = opt(
        "",
        "shared state of the gateway replicas: stored /v1/responses and their conversations "
        "(gateway/response_store.py); empty: a bounded in-process store, and previous_response_id "
        "is refused (another replica could not continue it)",
    )
    response_ttl_s: int = opt(
        30 * 24 * 3600, "how long a stored /v1/responses response (and its conversation) is kept"
    )

    def __post_init__(self) -> None:
        """Rejects values that cannot work, naming the offending option."""
        super().__post_init__()
        positive(self, "max_request_bytes")
        if not (self.request_timeout_s > 0 and math.isfinite(self.request_timeout_s)):
            raise ValueError("request_timeout_s must be a positive number")
        at_least(self, 1, "default_max_tokens")
        at_least(self, 1, "max_n")
        at_least(self, 0, "rate_limit_rps_per_key", "rate_limit_burst")
        at_least(self, 0, "tokens_per_minute_per_key", "requests_per_minute_per_key")
        at_least(self, 0, "models_cache_s")
        at_least(self, 1, "response_ttl_s")
        at_least(self, 1, "keep_alive_timeout_s")
        at_least(self, 0, "max_retries", "max_migrations")
        if not [a for a in self.scheduler_address.split(",") if a.strip()]:
            raise ValueError("scheduler_address must name at least one scheduler")
        if any(not key for key in self.api_keys + self.admin_api_keys):
            raise ValueError("api_keys and admin_api_keys must not contain empty keys")
        from gateway import reasoning, tool_parsers  # here: config must not import them eagerly
        from gateway.budgets import parse_key_budgets
        from gateway.classes import parse_classes, parse_key_classes

        parse_key_budgets(self.key_budgets, self.api_keys + self.admin_api_keys)
        parse_key_classes(self.key_classes, self.api_keys + self.admin_api_keys, parse_classes(self.classes))

        tool_parsers.check_spec(self.tool_call_parser)
        reasoning.check_name(self.reasoning_parser)
