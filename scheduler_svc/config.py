"""Scheduler process configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.config import DEFAULT_PORTS, ServerConfig, at_least, opt, positive
from services.kv_contract import DEFAULT_BLOCK_SIZE

ROUTING_POLICIES = ("prefix", "round_robin", "least_load")
PD_DECISIONS = ("estimate", "threshold")  # scheduler_svc/pd.py


@dataclass(frozen=True)
class SchedulerConfig(ServerConfig):
    """The global scheduler: worker registry, admission queue, routing and failover.

    `redis_url` empty keeps every piece of state local to this process (no KV events,
    no shared registry): routing then relies on heartbeats and its own decisions.
    """

    port: int = opt(DEFAULT_PORTS["scheduler"], "the gRPC port")
    redis_url: str = opt(
        "", "Redis shared by the replicas: registry, leases, KV events (empty: local state only)"
    )
    routing_policy: str = opt("prefix", "how a worker is chosen: " + ", ".join(ROUTING_POLICIES))
    heartbeat_interval_ms: int = opt(
        500, "how often workers report their load (told to them at registration)"
    )
    worker_timeout_s: float = opt(3.0, "a worker silent for this long gets no new requests")
    worker_forget_s: float = opt(
        60.0, "a worker silent for this long is forgotten (dropped from ListWorkers, Redis and the index)"
    )
    suspect_penalty_s: float = opt(
        2.0, "after a failed call a worker gets no new requests for this long (unless it is the last one)"
    )
    max_queue_len: int = opt(
        1024, "requests waiting for a worker at most; more are refused (RESOURCE_EXHAUSTED)"
    )
    queue_timeout_s: float = opt(
        60.0, "longest time a request may wait in the admission queue before RESOURCE_EXHAUSTED"
    )
    max_inflight_per_worker: int = opt(
        0, "requests this scheduler keeps in flight per worker (0: the worker's max_num_seqs)"
    )
    prefix_weight: float = opt(3.0, "prefix-aware scorer: weight of the longest-prefix hit fraction")
    queue_weight: float = opt(2.0, "prefix-aware scorer: weight of the queue depth")
    kv_weight: float = opt(1.0, "prefix-aware scorer: weight of the KV-cache usage")
    load_cap: float = opt(
        0.8,
        "a worker whose load reaches this fraction of its capacity gets no prefix affinity: the "
        "request falls back to least-load (one hot prefix cannot pile onto one worker)",
    )
    load_imbalance: float = opt(
        0.5,
        "no prefix affinity either for a worker whose load (with the request) would exceed the "
        "candidates' mean by more than this fraction of the mean and by more than "
        "--load-imbalance-min requests (a conversation may stay where its history is cached "
        "while the loads are close)",
    )
    load_imbalance_min: float = opt(2.0, "see --load-imbalance")
    load_spread: float = opt(
        2.0,
        "no prefix affinity either for a worker more than --load-spread-min requests and this "
        "many times above the lightest one (SGLang's absolute + relative thresholds)",
    )
    load_spread_min: float = opt(4.0, "see --load-spread")
    speculative_ttl_s: float = opt(
        2.0, "routing decisions count as cached prefixes for this long, until KV events confirm them"
    )
    max_retries: int = opt(2, "embedding calls retried on another worker after a transport failure")
    lease_ttl_s: float = opt(600.0, "a lease nobody released (and no worker reports) ends after this long")
    lease_grace_s: float = opt(
        2.0,
        "a lease its worker has not reported for this long (since issued or last reported) ends: "
        "shorter could end one whose request is still on its way to the worker, or whose release "
        "comes after the worker's next heartbeat",
    )
    block_size: int = opt(DEFAULT_BLOCK_SIZE, "tokens per KV block, as the workers' --block-size")
    kv_stream_maxlen: int = opt(100_000, "KV events kept per worker in its Redis stream")
    encoder_cache_address: str = opt(
        "",
        "encoder cache (host:port) checked before routing requests with images; empty: image "
        "inputs are refused (UNAVAILABLE)",
    )
    encoder_cache_timeout_s: float = opt(
        5.0, "deadline of each encoder cache call (a cache that is down fails requests fast)"
    )
    encode_timeout_s: float = opt(
        60.0, "deadline of one Worker.Encode call (encoder queue + vision tower + cache Put)"
    )
    bypass_encoder_cache: bool = opt(
        False, "skip the cache check and encode every image of every request (benchmarks)"
    )
    pd_min_prompt_tokens: int = opt(
        256,
        "P/D: a text request whose prompt tokens not cached on its decoder reach this many is "
        "prefilled on a prefill worker (when one is registered) and its KV pulled by the "
        "decoder; 0: never",
    )
    pd_decision: str = opt(
        "estimate",
        "P/D: which long prompts are handed off: estimate (each, unless the hand-off, the "
        "prefill worker's queue, the prefill and the pull at measured rates, is expected to "
        "end later than a prefill on the decoder behind its queue, by more than "
        "--pd-handoff-margin times the prompt's own prefill there) or "
        "threshold (every one)",
    )
    pd_handoff_margin: float = opt(
        0.5, "P/D: see --pd-decision; applies only with --pd-prefill-decodes off (scheduler_svc/pd.py)"
    )
    pd_prefill_decodes: bool = opt(
        True,
        "P/D: prefill workers also take whole requests (prefill and decode there): short ones "
        "where the routing policy ranks them best, as decoders do, long ones where they would "
        "compute them soonest; false: they only prefill hand-offs "
        '(docs/design-decisions.md, "P/D: prefill workers also take whole requests")',
    )
    kv_share_min_tokens: int = opt(
        0,
        "a decoder lacking at least this many leading prompt tokens that another decoder holds "
        "(cache or KV tier) pulls them from it instead of computing them (scheduler_svc/kv_share.py); "
        '0: off (docs/design-decisions.md, "KV tier: admission after repeated use, blocks kept in '
        "the router's index\")",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(
                f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing_policy!r}"
            )
        positive(self, "heartbeat_interval_ms")
        if self.pd_decision not in PD_DECISIONS:
            raise ValueError(
                f"pd_decision must be one of {', '.join(PD_DECISIONS)}, got {self.pd_decision!r}"
            )
        if self.worker_timeout_s * 1000 <= self.heartbeat_interval_ms:
            raise ValueError("worker_timeout_s must be longer than one heartbeat interval")
        if self.worker_forget_s < self.worker_timeout_s:
            raise ValueError("worker_forget_s must be >= worker_timeout_s")
        at_least(self, 0, "max_queue_len", "max_inflight_per_worker", "max_retries")
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
        if self.kv_share_min_tokens < 0:
            raise ValueError(f"kv_share_min_tokens must be >= 0, got {self.kv_share_min_tokens}")
        if self.pd_min_prompt_tokens < 0:
            raise ValueError(f"pd_min_prompt_tokens must be >= 0, got {self.pd_min_prompt_tokens}")
        positive(self, "block_size", "kv_stream_maxlen")
        positive(self, "encoder_cache_timeout_s", "encode_timeout_s")

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_interval_ms / 1000.0
