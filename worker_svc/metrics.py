"""Prometheus metrics of a decoder or prefill worker: gauges read from the engine's stats
when scraped, and the KV hand-off's counters (P/D disaggregation)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from meshserve.v1 import worker_pb2
from worker_svc.engine.kv_tier import TierStats

NUM_RUNNING = Gauge("meshserve_worker_num_running", "Requests in the running batch")
NUM_WAITING = Gauge("meshserve_worker_num_waiting", "Requests waiting for admission to the batch")
KV_USAGE = Gauge("meshserve_worker_kv_usage", "Fraction of KV cache blocks in use (0..1)")
PREFIX_HIT_RATE = Gauge(
    "meshserve_worker_prefix_cache_hit_rate", "Prefix cache hit rate over the worker lifetime"
)
PREEMPTIONS = Gauge("meshserve_worker_num_preemptions", "Preemptions (recompute) since start")
PRIORITY_PREEMPTIONS = Gauge(
    "meshserve_worker_num_priority_preemptions",
    "Of the preemptions, those for a waiting request of higher priority, since start",
)
FINISHED = Gauge("meshserve_worker_num_finished", "Requests finished since start")
# The rates the scheduler prices routes with (LoadStats): a KV tier block counts at 1 - their ratio.
PREFILL_RATE = Gauge(
    "meshserve_worker_prefill_tokens_per_s",
    "Tokens of long prompts per second of recent steps that computed some",
)
TIER_LOAD_RATE = Gauge(
    "meshserve_worker_kv_tier_load_tokens_per_s", "Prompt tokens per second of recent loads from the KV tier"
)

KV_TRANSFERS = Counter(
    "meshserve_worker_kv_transfers_total",
    "KV hand-offs a decode worker tried (P/D), by outcome: imported or fallback",
    ["outcome"],
)
KV_TRANSFER_FALLBACKS = Counter(
    "meshserve_worker_kv_transfer_fallbacks_total",
    "Hand-offs a decode worker gave up on and prefilled itself, by reason",
    ["reason"],
)
KV_TRANSFER_BYTES = Counter(
    "meshserve_worker_kv_transfer_bytes_total",
    "KV block bytes moved between workers, by direction: sent (prefill side) or received (decode side)",
    ["direction"],
)
KV_TRANSFER_SECONDS = Histogram(
    "meshserve_worker_kv_transfer_seconds",
    "Decode side: prefill call and pull of one hand-off, by phase (prefill, pull), successful ones",
    ["phase"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
KV_HANDOFF_ESTIMATE_RATIO = Histogram(
    "meshserve_worker_kv_handoff_estimate_ratio",
    "Decode side: a hand-off's seconds (prefill call and pull) over the scheduler's estimate of them",
    buckets=(0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 5, 10),
)

KV_TIER = {
    name: Gauge(f"meshserve_worker_kv_tier_{name}", help_text)
    for name, help_text in (
        ("blocks", "Blocks held in the KV tier now"),
        ("hit_tokens", "Prompt tokens loaded from the KV tier instead of computed, since start"),
        ("stored_blocks", "Blocks the cache evicted into the KV tier, since start"),
        ("loaded_blocks", "Blocks loaded from the KV tier back into the cache, since start"),
        ("evicted_blocks", "Blocks the KV tier dropped for room, since start"),
        ("corrupt_blocks", "KV tier blocks whose checksum failed (recomputed), since start"),
        ("bytes_written", "Bytes written into the KV tier, since start"),
        ("bytes_read", "Bytes read from the KV tier, since start"),
    )
}

LORA_LOADS = Gauge("meshserve_worker_lora_loads", "LoRA adapters copied into a compute slot since start")
LORA_EVICTIONS = Gauge(
    "meshserve_worker_lora_evictions", "Resident LoRA adapters replaced in their slot since start"
)
LORA_RESIDENT = Gauge("meshserve_worker_lora_resident", "LoRA adapters in a compute slot now")
LORA_REQUESTS = Counter(
    "meshserve_worker_lora_requests_total", "Requests started under a LoRA adapter", ["adapter"]
)


def watch(
    load: Callable[[], worker_pb2.LoadStats],
    loras: Callable[[], worker_pb2.LoraState | None],
    tier: Callable[[], TierStats | None] = lambda: None,
) -> None:
    """Reads the gauges from `load`, `loras` and `tier` whenever /metrics is scraped, so
    they are as fresh as the engine's latest step (all read its stats snapshot, safe from
    the metrics thread)."""
    fields: dict[Gauge, str] = {
        NUM_RUNNING: "num_running",
        NUM_WAITING: "num_waiting",
        KV_USAGE: "kv_usage",
        PREFIX_HIT_RATE: "prefix_cache_hit_rate",
        PREEMPTIONS: "num_preemptions",
        PRIORITY_PREEMPTIONS: "num_priority_preemptions",
        FINISHED: "num_finished",
        PREFILL_RATE: "prefill_tokens_per_s",
        TIER_LOAD_RATE: "kv_tier_load_tokens_per_s",
    }
    for gauge, name in fields.items():
        gauge.set_function(functools.partial(_field, load, name))
    for name, gauge in KV_TIER.items():
        gauge.set_function(functools.partial(_tier_field, tier, name))
    LORA_LOADS.set_function(lambda: float(_lora(loras).num_loads))
    LORA_EVICTIONS.set_function(lambda: float(_lora(loras).num_evictions))
    LORA_RESIDENT.set_function(lambda: float(len(_lora(loras).resident)))


def _field(load: Callable[[], worker_pb2.LoadStats], name: str) -> float:
    return float(getattr(load(), name))


def _tier_field(tier: Callable[[], TierStats | None], name: str) -> float:
    stats = tier()
    return float(getattr(stats, name)) if stats is not None else 0.0


def _lora(loras: Callable[[], worker_pb2.LoraState | None]) -> worker_pb2.LoraState:
    return loras() or worker_pb2.LoraState()  # LoRA off: every LoRA gauge reads 0
