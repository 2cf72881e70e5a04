"""Worker registry: who serves what, how loaded each worker is, and whether it is alive.

Pure domain code (no grpc, no Redis): the servicer feeds it registrations and heartbeats,
a periodic sweep marks silent workers unhealthy, and the Redis mirror merges entries seen
by other scheduler replicas through `observe_remote`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from services.clock import Clock
from services.worker_roles import ROLES


class Health(StrEnum):
    """The state a worker is in, as exported in metrics and ListWorkers."""

    HEALTHY = "healthy"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker announced on registration."""

    worker_id: str
    address: str
    role: str = "decoder"
    model: str = ""
    max_model_len: int = 0
    block_size: int = 16
    num_total_blocks: int = 0
    max_num_seqs: int = 1
    # Decoders and prefill workers: their KV layout as one string (model, dtype, layers,
    # KV heads, head dim, block size); a prefill worker pairs only with an equal one.
    kv_layout: str = ""

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        if not self.worker_id:
            raise ValueError("worker.worker_id is required")
        if not self.address:
            raise ValueError("worker.address is required")
        if self.role not in ROLES:
            raise ValueError(f"worker.role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.model:
            raise ValueError("worker.model is required")
        if self.block_size <= 0 or self.max_num_seqs <= 0:
            raise ValueError("worker.block_size and worker.max_num_seqs must be > 0")


@dataclass(frozen=True)
class LoadSnapshot:
    """A worker's self-reported load (LoadStats)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_finished: int = 0
    queued_prompt_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    kv_import_tokens_per_s: float = 0.0
    num_priority_preemptions: int = 0
    kv_tier_load_tokens_per_s: float = 0.0
    # LoRA adapters requests may name on this worker, and those in a compute slot now.
    lora_loaded: tuple[str, ...] = ()
    lora_resident: tuple[str, ...] = ()
    lora_slots: int = 0  # its max_loras

    def __post_init__(self) -> None:
        # From the Redis mirror's JSON the names arrive as lists.
        object.__setattr__(self, "lora_loaded", tuple(self.lora_loaded))
        object.__setattr__(self, "lora_resident", tuple(self.lora_resident))


@dataclass
class WorkerState:
    """Registry entry of one worker: spec, last load, liveness and our own in-flight count."""

    spec: WorkerSpec
    load: LoadSnapshot = field(default_factory=LoadSnapshot)
    last_seen: float = 0.0
    healthy: bool = True
    draining: bool = False
    suspect_until: float = 0.0
    # Requests this scheduler sent and that have not finished yet.
    inflight: int = 0
    # Requests on the worker that are not ours (other scheduler replicas), from its last report.
    external_load: int = 0
    # Prompt tokens of this scheduler's routes here that the worker has not listed yet
    # (leases.py): its queue its reports lack (pd.py).
    routed_prompt_tokens: int = 0
    capacity: int = 1
    # LoRA adapter -> requests for it this scheduler sent here that have not finished yet
    # (an adapter leaves the dict with its last request: `release`).
    adapter_inflight: dict[str, int] = field(default_factory=dict)
    # Priority -> requests of that priority this scheduler sent here, not finished yet.
    priority_inflight: dict[int, int] = field(default_factory=dict)

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def health(self) -> Health:
        if not self.healthy:
            return Health.UNHEALTHY
        return Health.DRAINING if self.draining else Health.HEALTHY

    def routable(self) -> bool:
        """Healthy and accepting new requests (suspects are routable only as a last resort)."""
        return self.healthy and not self.draining

    def is_suspect(self, now: float) -> bool:
        return now < self.suspect_until

    def has_capacity(self) -> bool:
        """Room for one more request of ours."""
        return self.inflight < self.capacity

    def can_displace(self, priority: int) -> bool:
        """Full, but a request of ``priority`` may go here anyway: some of ours here have a
        lower priority (the engine preempts one for it), and ours of ``priority`` or higher
        leave room in the capacity (docs/architecture.md, "Priority")."""
        if not any(p < priority for p in self.priority_inflight):
            return False
        return sum(n for p, n in self.priority_inflight.items() if p >= priority) < self.capacity

    def estimated_load(self) -> int:
        """Requests on the worker now: ours (exact, heartbeats lag) plus other replicas' (reported)."""
        return self.inflight + self.external_load

    def load_fraction(self) -> float:
        return self.estimated_load() / max(self.capacity, 1)

    def serves(self, model: str) -> bool:
        """Whether requests for `model` (its base model, or a LoRA adapter it has loaded) can run here."""
        return self.spec.model == model or model in self.load.lora_loaded

    def adapter_resident(self, adapter: str) -> bool:
        """`adapter` is in a compute slot here, as last reported, or requests of ours for it
        run or wait here (its heartbeat may not list it yet; the next requests for it then
        share its one load instead of loading it on another worker too)."""
        return adapter in self.load.lora_resident or adapter in self.adapter_inflight

    def adapter_affinity(self, adapter: str) -> float:
        """1 when `adapter` is resident here (`adapter_resident`), 0.5 when a slot is free for
        it (no other adapter evicted), else 0."""
        if self.adapter_resident(adapter):
            return 1.0
        busy = set(self.load.lora_resident) | set(self.adapter_inflight)
        return 0.5 if len(busy) < self.load.lora_slots else 0.0


@dataclass(frozen=True)
class Lease:
    """One request dispatched to one worker; hand it back with `WorkerRegistry.release`."""

    worker: WorkerState
    dispatched_at: float
    adapter: str = ""  # the request's LoRA adapter ("" for a base model)
    priority: int = 0  # the request's (higher first)


@dataclass(eq=False)
class WorkerRegistry:
    """All known workers, keyed by worker_id."""

    timeout_s: float
    forget_s: float
    max_inflight_per_worker: int = 0
    clock: Clock = time.monotonic
    # P/D: prefill workers also take whole requests (SchedulerConfig.pd_prefill_decodes).
    prefill_decodes: bool = False
    _workers: dict[str, WorkerState] = field(default_factory=dict, init=False)
    version: int = field(default=0, init=False)  # bumped whenever routability may have changed

    def now(self) -> float:
        return self.clock()

    def _capacity(self, spec: WorkerSpec) -> int:
        return self.max_inflight_per_worker if self.max_inflight_per_worker > 0 else max(spec.max_num_seqs, 1)

    def register(self, spec: WorkerSpec) -> tuple[WorkerState, bool]:
        """Adds or replaces a worker (a restart re-registers); returns (state, is_new)."""
        spec.validate()
        now = self.clock()
        state = self._workers.get(spec.worker_id)
        is_new = state is None
        if state is None:
            state = WorkerState(spec=spec)
            self._workers[spec.worker_id] = state
        state.spec = spec
        state.capacity = self._capacity(spec)
        state.load = LoadSnapshot(num_total_blocks=spec.num_total_blocks)
        state.last_seen = now
        state.healthy = True
        state.draining = False
        state.suspect_until = 0.0
        state.external_load = 0
        self.version += 1
        return state, is_new

    def heartbeat(self, worker_id: str, load: LoadSnapshot, draining: bool) -> tuple[bool, bool]:
        """Records a heartbeat; returns (known, revived) where revived means it was unhealthy."""
        state = self._workers.get(worker_id)
        if state is None:
            return False, False
        revived = not state.healthy
        if revived or state.draining != draining:
            self.version += 1
        state.load = load
        state.last_seen = self.clock()
        state.healthy = True
        state.draining = draining
        state.external_load = max(load.num_running + load.num_waiting - state.inflight, 0)
        return True, revived

    def observe_remote(self, spec: WorkerSpec, load: LoadSnapshot, draining: bool, age_s: float) -> bool:
        """Merges an entry another scheduler replica wrote; True when it changed ours."""
        seen = self.clock() - max(age_s, 0.0)
        if age_s > self.timeout_s:
            return False
        state = self._workers.get(spec.worker_id)
        if state is not None and state.last_seen >= seen:
            return False
        if state is None or state.spec != spec:
            state, _ = self.register(spec)
        if not state.healthy or state.draining != draining:
            self.version += 1
        state.load = load
        state.external_load = max(load.num_running + load.num_waiting - state.inflight, 0)
        state.draining = draining
        state.healthy = True
        state.last_seen = seen
        return True

    def sweep(self) -> tuple[list[str], list[str]]:
        """Marks workers silent for > timeout unhealthy and forgets long-gone ones.

        Returns (newly unhealthy ids, forgotten ids).
        """
        now = self.clock()
        down: list[str] = []
        gone: list[str] = []
        for worker_id, state in list(self._workers.items()):
            silent = now - state.last_seen
            if silent > self.forget_s and state.inflight == 0:
                del self._workers[worker_id]
                gone.append(worker_id)
            elif silent > self.timeout_s and state.healthy:
                state.healthy = False
                down.append(worker_id)
        if down or gone:
            self.version += 1
        return down, gone

    def mark_down(self, worker_id: str) -> bool:
        """Marks a worker unhealthy at once (e.g. it is known dead); True when it was healthy."""
        state = self._workers.get(worker_id)
        if state is None or not state.healthy:
            return False
        state.healthy = False
        self.version += 1
        return True

    def mark_suspect(self, worker_id: str, penalty_s: float) -> None:
        """Keeps a worker out of routing for `penalty_s` after a failed call."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.suspect_until = self.clock() + penalty_s
            self.version += 1

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def serving(self, model: str, role: str) -> list[WorkerState]:
        """Every registered worker (healthy or not) taking `role`'s requests for `model`: the
        workers of that role, and for decoding the prefill workers too when `prefill_decodes`."""
        roles = (role, "prefill") if role == "decoder" and self.prefill_decodes else (role,)
        return [w for w in self._workers.values() if w.serves(model) and w.spec.role in roles]

    def candidates(self, model: str, role: str, exclude: Iterable[str] = ()) -> list[WorkerState]:
        """Routable workers for (model, role); suspects only when nothing else is left."""
        excluded = set(exclude)
        routable = [w for w in self.serving(model, role) if w.routable() and w.worker_id not in excluded]
        now = self.clock()
        trusted = [w for w in routable if not w.is_suspect(now)]
        return trusted or routable

    def models(self, healthy_only: bool = True) -> list[str]:
        """Served models: base models and the LoRA adapters loaded on their workers."""
        names: set[str] = set()
        for w in self._workers.values():
            if w.healthy or not healthy_only:
                names.add(w.spec.model)
                names.update(w.load.lora_loaded)
        return sorted(names)

    def is_adapter(self, model: str) -> bool:
        """Whether `model` names a LoRA adapter (on some worker) rather than a base model."""
        workers = self._workers.values()
        return any(model in w.load.lora_loaded for w in workers) and not any(
            w.spec.model == model for w in workers
        )

    def acquire(self, state: WorkerState, adapter: str = "", priority: int = 0) -> Lease:
        """Counts one more request in flight on `state` (for LoRA adapter `adapter`)."""
        state.inflight += 1
        if adapter:
            state.adapter_inflight[adapter] = state.adapter_inflight.get(adapter, 0) + 1
        state.priority_inflight[priority] = state.priority_inflight.get(priority, 0) + 1
        return Lease(worker=state, dispatched_at=self.clock(), adapter=adapter, priority=priority)

    def release(self, lease: Lease) -> None:
        state = lease.worker
        state.inflight = max(state.inflight - 1, 0)
        if lease.adapter:
            left = state.adapter_inflight.get(lease.adapter, 0) - 1
            if left > 0:
                state.adapter_inflight[lease.adapter] = left
            else:
                state.adapter_inflight.pop(lease.adapter, None)
        left = state.priority_inflight.get(lease.priority, 0) - 1
        if left > 0:
            state.priority_inflight[lease.priority] = left
        else:
            state.priority_inflight.pop(lease.priority, None)

    def counts(self) -> dict[tuple[str, Health], int]:
        """Number of workers per (role, health), every combination present."""
        result = {(role, health): 0 for role in ROLES for health in Health}
        for state in self._workers.values():
            key = (state.spec.role, state.health)
            result[key] = result.get(key, 0) + 1
        return result
