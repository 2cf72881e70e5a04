"""Prometheus metrics of a decoder or prefill worker: gauges refreshed from engine stats,
and the KV hand-off's counters (P/D disaggregation)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from meshserve.v1 import worker_pb2

NUM_RUNNING = Gauge("meshserve_worker_num_running", "Requests in the running batch")
NUM_WAITING = Gauge("meshserve_worker_num_waiting", "Requests waiting for admission to the batch")
KV_USAGE = Gauge("meshserve_worker_kv_usage", "Fraction of KV cache blocks in use (0..1)")
PREFIX_HIT_RATE = Gauge(
    "meshserve_worker_prefix_cache_hit_rate", "Prefix cache hit rate over the worker lifetime"
)
PREEMPTIONS = Gauge("meshserve_worker_num_preemptions", "Preemptions (recompute) since start")
FINISHED = Gauge("meshserve_worker_num_finished", "Requests finished since start")

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


def record(load: worker_pb2.LoadStats) -> worker_pb2.LoadStats:
    """Publishes `load` to the gauges and returns it (so it can wrap a load function)."""
    NUM_RUNNING.set(load.num_running)
    NUM_WAITING.set(load.num_waiting)
    KV_USAGE.set(load.kv_usage)
    PREFIX_HIT_RATE.set(load.prefix_cache_hit_rate)
    PREEMPTIONS.set(load.num_preemptions)
    FINISHED.set(load.num_finished)
    return load
