"""Prometheus metrics of the scheduler (exposed on its --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from scheduler_svc.registry import WorkerRegistry

WORKERS = Gauge(
    "meshserve_scheduler_workers",
    "Registered workers by role and health (healthy, draining, unhealthy)",
    ["role", "health"],
)
WORKER_INFLIGHT = Gauge(
    "meshserve_scheduler_worker_inflight",
    "Requests this scheduler has in flight on each worker",
    ["worker_id"],
)
QUEUE_DEPTH = Gauge("meshserve_scheduler_queue_depth", "Requests waiting in the admission queue")
OVERHEAD = Histogram(
    "meshserve_scheduler_overhead_seconds",
    "Route: time from receiving the route to answering the lease (admission + encoding + routing + queueing)",
    buckets=(
        0.0001,
        0.00025,
        0.0005,
        0.00075,
        0.001,
        0.0015,
        0.002,
        0.003,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1,
        2.5,
        5,
        10,
        30,
        60,
    ),
)
POLICY_SECONDS = Histogram(
    "meshserve_scheduler_policy_seconds",
    "Time the routing policy takes to choose a worker (prompt hashing, prefix match, scoring)",
    ["policy"],
    buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
)
QUEUE_WAIT = Histogram(
    "meshserve_scheduler_queue_wait_seconds",
    "Time requests spent in the admission queue (only those that had to wait)",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
SHED = Counter(
    "meshserve_scheduler_shed_total",
    "Requests refused (RESOURCE_EXHAUSTED) for their class: no_free_worker (a class that never "
    "waits, no worker free) or queue_full (pushed out of the full queue by a higher priority)",
    ["reason"],
)
ROUTED = Counter(
    "meshserve_scheduler_routed_total",
    "Routing decisions by policy and reason (prefix, score, load_cap, round_robin, least_load)",
    ["policy", "reason"],
)
ADAPTER_ROUTES = Counter(
    "meshserve_scheduler_adapter_routes_total",
    "Requests routed per LoRA adapter, by whether it was resident on the chosen worker",
    ["adapter", "resident"],
)
PREFIX_HIT = Histogram(
    "meshserve_scheduler_prefix_hit_ratio",
    "Fraction of the prompt's full blocks the chosen worker already held, at routing time",
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
)
_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CACHED_TOKENS = Histogram(
    "meshserve_scheduler_cached_tokens",
    "Prompt tokens found in the chosen worker's prefix cache per request: kind=predicted (the "
    "prefix index at routing time) or actual (the worker's usage, reported on release)",
    ["policy", "kind"],
    buckets=_TOKEN_BUCKETS,
)
CACHED_TOKENS_ERROR = Histogram(
    "meshserve_scheduler_cached_tokens_error",
    "Per request, actual minus predicted cached tokens (negative: the index promised blocks "
    "the worker no longer had; positive: the worker had more than the index knew)",
    ["policy"],
    buckets=(-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096),
)
CACHE_PREDICTIONS = Counter(
    "meshserve_scheduler_cache_predictions_total",
    "Requests whose actual cached tokens were reported, by outcome: exact, over (predicted "
    "more than the worker had: index drift) or under (predicted less)",
    ["policy", "outcome"],
)
REJECTED = Counter(
    "meshserve_scheduler_rejected_total",
    "Requests refused before reaching a worker, by status code",
    ["code"],
)
FAILOVERS = Counter(
    "meshserve_scheduler_failovers_total",
    "Routes asked again by a gateway after a worker failed before the first token (outcome=rerouted)",
    ["outcome"],
)
LEASES = Gauge(
    "meshserve_scheduler_leases",
    "Leases this replica holds (requests routed and not ended yet)",
)
LEASES_ENDED = Counter(
    "meshserve_scheduler_leases_ended_total",
    "Leases ended, by how: released (by the gateway), reconciled (the worker no longer runs "
    "it), expired (TTL), worker_down",
    ["how"],
)
KV_EVENTS = Counter(
    "meshserve_scheduler_kv_events_total",
    "KV events read from the stream, by result (applied, duplicate, resync)",
    ["result"],
)
KV_RESYNCS = Counter(
    "meshserve_scheduler_kv_resyncs_total", "Per-worker prefix index reloads from Redis block sets"
)
REDIS_UP = Gauge("meshserve_scheduler_redis_up", "1 when the scheduler can reach Redis (0 = local state)")


def update_worker_gauges(registry: WorkerRegistry) -> None:
    """Refreshes the workers-by-role/health and in-flight gauges from the registry."""
    for (role, health), count in registry.counts().items():
        WORKERS.labels(role=role, health=health.value).set(count)
    for state in registry.all():
        WORKER_INFLIGHT.labels(worker_id=state.worker_id).set(state.inflight)


def forget_worker(worker_id: str) -> None:
    try:
        WORKER_INFLIGHT.remove(worker_id)
    except KeyError:
        pass


KV_SHARES = Counter(
    "meshserve_scheduler_kv_shares_total",
    "Routes whose decoder lacked a prefix another decoder holds (kv_share_min_tokens or more), "
    "by decision: shared (it pulls them) or pull_slower (computing them is faster)",
    ["decision"],
)
PD_DECISIONS = Counter(
    "meshserve_scheduler_pd_decisions_total",
    "Routes of text prompts when P/D is on (pd_min_prompt_tokens > 0), by decision: "
    "disaggregated, short (uncached prompt below the threshold), local_faster (the hand-off "
    "was expected to be slower than a local prefill, by more than the margin where it applies), "
    "no_prefill_worker, on_prefill_worker (a prefill worker runs the request whole: "
    "pd_prefill_decodes)",
    ["decision"],
)
