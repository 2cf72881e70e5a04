"""Routing policies: pick one worker for a request among candidates with capacity.

Pure domain code. `make_policy` builds the one named by `SchedulerConfig.routing_policy`:

* ``round_robin`` cycles through workers in worker_id order;
* ``least_load`` takes the worker with the fewest requests relative to its capacity,
  then the lowest KV usage;
* ``prefix`` (default) scores every worker with
  ``prefix_weight * hit + queue_weight * idle + kv_weight * (1 - kv_usage)`` where ``hit``
  is the fraction of the prompt's full blocks the worker already holds (longest prefix,
  from the `PrefixIndex`) and ``idle = (min_load + 1) / (load + 1)`` compares its queue
  depth (running + waiting) with the least loaded candidate's (1 = least loaded; a
  one-request difference matters between idle workers, little between busy ones) --
  llm-d's endpoint picker (precise prefix-cache scorer + queue and KV scorers, weighted).
  The load cap, SGLang's cache-aware router's fallback: a worker at or above ``load_cap``
  of its capacity (while another is below it), or whose load with this request would exceed the candidates' mean by
  more than ``max(load_imbalance * mean, load_imbalance_min)`` requests, gets no
  affinity -- the request goes to the best-scoring worker within the cap (least-load when
  none is), so a hot prefix cannot pile onto one worker, while a moderate imbalance (a
  conversation staying where its history is cached) is allowed.
  A request for a LoRA adapter adds ``adapter_weight * affinity`` (1 where the adapter is
  in a compute slot, or requests for it are in flight: no adapter swap there, and waiting
  requests of one adapter share one load; 0.5 where a slot is free: nothing evicted); the load cap applies the same, so a hot adapter spreads to a
  second worker (which loads it into a slot) rather than queueing behind one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.prefix_index import PrefixIndex
from scheduler_svc.registry import WorkerState
from services.config import default_of
from services.kv_hash import block_hashes


@dataclass
class RoutingRequest:
    """What routing needs to know about a request; prompt hashes are computed once per block size."""

    request_id: str
    model: str
    token_ids: Sequence[int] = ()
    extra_keys: tuple[str, ...] = ()
    priority: int = 0
    tenant: str = ""
    role: str = "decoder"
    # The LoRA adapter `model` names ("" for a base model).
    adapter: str = ""
    # Longest wait in the admission queue (its priority class); None: the scheduler's.
    queue_timeout_s: float | None = None
    # The role of the workers a prompt P/D may hand off runs on (pd.py): "decoder" (then
    # prefilled there or handed off), "prefill" (whole there: a prefill worker computes it
    # soonest); another role's worker only when none of that role can take it. "": any.
    only_role: str = ""
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def hashes(self, block_size: int) -> list[int]:
        cached = self._hashes.get(block_size)
        if cached is None:
            cached = block_hashes(self.token_ids, block_size, self.extra_keys)
            self._hashes[block_size] = cached
        return cached


@dataclass(frozen=True)
class Decision:
    """The chosen worker and why (for metrics and logs)."""

    worker: WorkerState
    reason: str
    matched_blocks: int = 0
    total_blocks: int = 0


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> Decision:
        """Picks one of `candidates` (never empty; all routable and with capacity)."""
        ...


class RoundRobinPolicy:
    """Cycles through workers in worker_id order, stable when membership changes."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last = ""

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> Decision:
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        chosen = next((w for w in ordered if w.worker_id > self._last), ordered[0])
        self._last = chosen.worker_id
        return Decision(chosen, "round_robin")


def _load_key(worker: WorkerState) -> tuple[float, float]:
    return (worker.load_fraction(), worker.load.kv_usage)


class LeastLoadPolicy:
    """Fewest requests per unit of capacity, then lowest KV usage; ties rotate."""

    name = "least_load"

    def __init__(self) -> None:
        self._tiebreak = RoundRobinPolicy()

    def pick(self, candidates: Sequence[WorkerState]) -> WorkerState:
        best = min(_load_key(w) for w in candidates)
        tied = [w for w in candidates if _load_key(w) == best]
        return tied[0] if len(tied) == 1 else self._tiebreak.choose(RoutingRequest("", ""), tied).worker

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> Decision:
        return Decision(self.pick(candidates), "least_load")


@dataclass(frozen=True)
class PrefixWeights:
    """The prefix-aware policy's weights and load limits; their defaults are the
    scheduler's options of the same meaning (--prefix-weight, --load-cap, ...)."""

    prefix: float = default_of(SchedulerConfig, "prefix_weight")
    queue: float = default_of(SchedulerConfig, "queue_weight")
    kv: float = default_of(SchedulerConfig, "kv_weight")
    adapter: float = 2.0
    load_cap: float = default_of(SchedulerConfig, "load_cap")
    # Allowed excess over the mean load: a fraction of the mean, at least `load_imbalance_min`.
    load_imbalance: float = default_of(SchedulerConfig, "load_imbalance")
    load_imbalance_min: float = default_of(SchedulerConfig, "load_imbalance_min")
    # SGLang's rule against the lightest worker: over `load_spread` x its load (+1 each)
    # and more than `load_spread_min` requests above it (an idle worker left idle).
    load_spread: float = default_of(SchedulerConfig, "load_spread")
    load_spread_min: float = default_of(SchedulerConfig, "load_spread_min")

    @classmethod
    def of(cls, config: SchedulerConfig) -> PrefixWeights:
        """The weights `config`'s options set, each by name (`adapter` has no option)."""
        return cls(**{name: getattr(config, option) for name, option in WEIGHT_OPTIONS.items()})


# Each weight the scheduler's options set, and its option.
WEIGHT_OPTIONS = {
    "prefix": "prefix_weight",
    "queue": "queue_weight",
    "kv": "kv_weight",
    "load_cap": "load_cap",
    "load_imbalance": "load_imbalance",
    "load_imbalance_min": "load_imbalance_min",
    "load_spread": "load_spread",
    "load_spread_min": "load_spread_min",
}


def tier_load_cost(worker: WorkerState) -> float:
    """What loading a block from the worker's KV tier costs as a fraction of computing it
    there: its prefill rate over its tier load rate, both measured by the worker (1 at
    most). 0 until both are measured: a tier block then counts as a cached one."""
    load = worker.load
    if load.kv_tier_load_tokens_per_s <= 0.0 or load.prefill_tokens_per_s <= 0.0:
        return 0.0
    return min(1.0, load.prefill_tokens_per_s / load.kv_tier_load_tokens_per_s)


class PrefixAwarePolicy:
    """Longest cached prefix weighed against queue depth and KV usage, with a load cap."""

    name = "prefix"

    def __init__(
        self,
        index: PrefixIndex,
        weights: PrefixWeights | None = None,
    ) -> None:
        self._index = index
        self._weights = weights or PrefixWeights()
        self._least_load = LeastLoadPolicy()

    def _matches(
        self, request: RoutingRequest, candidates: Sequence[WorkerState]
    ) -> dict[str, tuple[int, int, float]]:
        """worker_id -> (matched blocks, total blocks, matched blocks as priced: one in the
        worker's KV tier counts for what loading it saves, `tier_load_cost`), hashing once
        per block size."""
        by_id = {w.worker_id: w for w in candidates}
        result: dict[str, tuple[int, int, float]] = {}
        for size in {w.spec.block_size for w in candidates}:
            hashes = request.hashes(size)
            group = [w.worker_id for w in candidates if w.spec.block_size == size]
            for worker_id, matched in self._index.match(hashes, group).items():
                tiered = self._index.tier_blocks(worker_id, hashes[:matched]) if matched else 0
                priced = matched - tiered * tier_load_cost(by_id[worker_id])
                result[worker_id] = (matched, len(hashes), priced)
        return result

    def scores(
        self,
        request: RoutingRequest,
        candidates: Sequence[WorkerState],
        matches: dict[str, tuple[int, int, float]] | None = None,
    ) -> dict[str, float]:
        """The score of every candidate (higher is better)."""
        if matches is None:
            matches = self._matches(request, candidates)
        loads = [w.estimated_load() for w in candidates]
        low = min(loads)
        result: dict[str, float] = {}
        for worker, load in zip(candidates, loads, strict=True):
            _, total, priced = matches[worker.worker_id]
            hit = priced / total if total else 0.0
            idle = (low + 1) / (load + 1)
            kv_free = 1.0 - min(max(worker.load.kv_usage, 0.0), 1.0)
            w = self._weights
            affinity = worker.adapter_affinity(request.adapter) if request.adapter else 0.0
            result[worker.worker_id] = w.prefix * hit + w.queue * idle + w.kv * kv_free + w.adapter * affinity
        return result

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> Decision:
        matches = self._matches(request, candidates)
        scores = self.scores(request, candidates, matches)
        best = self._best(candidates, scores)
        reason = "prefix" if matches[best.worker_id][0] else "score"
        if self._over_cap(best, candidates):
            allowed = [w for w in candidates if not self._over_cap(w, candidates)]
            best = self._best(allowed, scores) if allowed else self._least_load.pick(candidates)
            reason = "load_cap"
        matched, total, _ = matches[best.worker_id]
        self._index.add_speculative(best.worker_id, request.hashes(best.spec.block_size))
        return Decision(best, reason, matched, total)

    def _best(self, candidates: Sequence[WorkerState], scores: dict[str, float]) -> WorkerState:
        """Highest score; ties go to the least loaded (rotating among equals)."""
        top_score = max(scores[w.worker_id] for w in candidates)
        top = [w for w in candidates if scores[w.worker_id] == top_score]
        return top[0] if len(top) == 1 else self._least_load.pick(top)

    def _over_cap(self, worker: WorkerState, candidates: Sequence[WorkerState]) -> bool:
        """At `load_cap` of its capacity while another candidate is below it, or (with this
        request) above the candidates' mean load by more than `load_imbalance` of the mean
        (at least `load_imbalance_min`), or above the lightest worker by more than
        `load_spread_min` requests and `load_spread` times its load. When every worker is at the cap, only the relative
        rule applies: moving a request from one full worker to another gains nothing and
        loses its cached prefix."""
        w = self._weights
        if worker.load_fraction() >= w.load_cap and any(c.load_fraction() < w.load_cap for c in candidates):
            return True
        load = worker.estimated_load()
        loads = [c.estimated_load() for c in candidates]
        mean = (sum(loads) + 1) / len(candidates)
        if load + 1 - mean > max(w.load_imbalance * mean, w.load_imbalance_min):
            return True
        lightest = min(loads)
        return load - lightest > w.load_spread_min and load + 1 > w.load_spread * (lightest + 1)


def make_policy(name: str, index: PrefixIndex, weights: PrefixWeights | None = None) -> RoutingPolicy:
    """The policy named by `SchedulerConfig.routing_policy`."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "prefix":
        return PrefixAwarePolicy(index, weights)
    raise ValueError(f"unknown routing policy {name!r}")
