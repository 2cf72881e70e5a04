"""Scheduler process configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.config import ServerConfig

ROUTING_POLICIES = ("prefix", "round_robin", "least_load")


@dataclass(frozen=True)
class SchedulerConfig(ServerConfig):
    """The global scheduler: worker registry, admission queue, routing and failover.

    `redis_url` empty keeps every piece of state local to this process (no KV events,
    no shared registry): routing then relies on heartbeats and its own decisions.
    """

    port: int = 50052
    redis_url: str = ""
    routing_policy: str = "prefix"
    heartbeat_interval_ms: int = 500
    worker_timeout_s: float = 3.0
    # A worker silent for this long is forgotten (dropped from ListWorkers, Redis and the index).
    worker_forget_s: float = 60.0
    # After a failed call a worker gets no new requests for this long (unless it is the last one).
    suspect_penalty_s: float = 2.0
    max_queue_len: int = 1024
    # Longest time a request may wait in the admission queue before RESOURCE_EXHAUSTED.
    queue_timeout_s: float = 60.0
    # Requests this scheduler keeps in flight per worker (0 = the worker's max_num_seqs).
    max_inflight_per_worker: int = 0
    # Prefix-aware scorer weights: longest-prefix hit fraction, queue depth, KV usage.
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 1.0
    # A worker whose load reaches this fraction of its capacity gets no prefix affinity:
    # the request falls back to least-load (one hot prefix cannot pile onto one worker).
    load_cap: float = 0.8
    # ... and so does a worker whose load (with the request) would exceed the candidates'
    # mean load by more than this fraction of the mean, and by more than
    # load_imbalance_min requests (affinity must not turn into a lasting imbalance, yet a
    # conversation may stay where its history is cached while the loads are close).
    load_imbalance: float = 0.5
    load_imbalance_min: float = 2.0
    # ... and so does a worker more than load_spread_min requests and load_spread times
    # above the lightest one (SGLang's absolute + relative thresholds).
    load_spread: float = 2.0
    load_spread_min: float = 4.0
    # Routing decisions count as cached prefixes for this long, until KV events confirm them.
    speculative_ttl_s: float = 2.0
    # Embedding calls retried on another worker after a transport failure.
    max_retries: int = 2
    # A lease nobody released (and no worker reports) ends after this long.
    lease_ttl_s: float = 600.0
    # A lease its worker has not reported for this long (since issued or last reported)
    # ends: shorter could end one whose request is still on its way to the worker, or
    # whose release (with the request's outcome) comes after the worker's next heartbeat.
    lease_grace_s: float = 2.0
    block_size: int = 16
    kv_stream_maxlen: int = 100_000
    # Encoder cache (host:port) checked before routing requests with images; empty = the
    # scheduler refuses image inputs (UNAVAILABLE).
    encoder_cache_address: str = ""
    # Deadline of each encoder cache call: a cache that is down fails requests fast.
    encoder_cache_timeout_s: float = 5.0
    # Deadline of one Worker.Encode call (encoder queue + vision tower + cache Put).
    encode_timeout_s: float = 60.0
    # Skip the cache check and encode every image of every request (benchmarks).
    bypass_encoder_cache: bool = False
    # P/D disaggregation: a text request whose prompt tokens not cached on its decoder
    # reach this many is prefilled on a prefill worker (role "prefill", when one is
    # registered) and its KV pulled by the decoder; 0 = never.
    pd_min_prompt_tokens: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(
                f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing_policy!r}"
            )
        if self.heartbeat_interval_ms <= 0:
            raise ValueError("heartbeat_interval_ms must be > 0")
        if self.worker_timeout_s * 1000 <= self.heartbeat_interval_ms:
            raise ValueError("worker_timeout_s must be longer than one heartbeat interval")
        if self.worker_forget_s < self.worker_timeout_s:
            raise ValueError("worker_forget_s must be >= worker_timeout_s")
        if self.max_queue_len < 0 or self.max_inflight_per_worker < 0 or self.max_retries < 0:
            raise ValueError("max_queue_len, max_inflight_per_worker and max_retries must be >= 0")
        if self.queue_timeout_s <= 0 or self.suspect_penalty_s < 0 or self.speculative_ttl_s < 0:
            raise ValueError("queue_timeout_s must be > 0; suspect_penalty_s, speculative_ttl_s >= 0")
        if min(self.prefix_weight, self.queue_weight, self.kv_weight) < 0:
            raise ValueError("routing weights must be >= 0")
        if self.lease_ttl_s <= 0 or self.lease_grace_s < 0:
            raise ValueError("lease_ttl_s must be > 0 and lease_grace_s >= 0")
        if not 0 < self.load_cap <= 1:
            raise ValueError(f"load_cap must be in (0, 1], got {self.load_cap}")
        if self.load_spread < 1 or self.load_spread_min < 0:
            raise ValueError(f"load_spread must be >= 1 and load_spread_min >= 0, got {self.load_spread}")
        if self.load_imbalance <= 0 or self.load_imbalance_min < 0:
            raise ValueError(
                f"load_imbalance must be > 0 and load_imbalance_min >= 0, got "
                f"{self.load_imbalance}, {self.load_imbalance_min}"
            )
        if self.pd_min_prompt_tokens < 0:
            raise ValueError(f"pd_min_prompt_tokens must be >= 0, got {self.pd_min_prompt_tokens}")
        if self.block_size <= 0 or self.kv_stream_maxlen <= 0:
            raise ValueError("block_size and kv_stream_maxlen must be > 0")
        if self.encoder_cache_timeout_s <= 0 or self.encode_timeout_s <= 0:
            raise ValueError("encoder_cache_timeout_s and encode_timeout_s must be > 0")

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_interval_ms / 1000.0
