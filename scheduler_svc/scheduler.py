"""The scheduler's state and background work, independent of the gRPC servicer.

`Scheduler` wires the registry, prefix index, routing policy and admission queue
together, owns the worker channels, the leases of its route answers (`LeaseTable`) and
the optional Redis links (registry mirror and KV event subscriber), and runs a
housekeeping loop: mark silent workers down (dropping their index entries and leases),
expire leases, sync the registry with Redis, refresh gauges and admit queued requests
when capacity appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from scheduler_svc import metrics
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.dispatcher import Dispatcher
from scheduler_svc.kv_subscriber import KvSubscriber
from scheduler_svc.leases import LeaseRecord, LeaseTable
from scheduler_svc.policies import Decision, PrefixWeights, RoutingRequest, make_policy
from scheduler_svc.prefix_index import PrefixIndex
from scheduler_svc.registry import LoadSnapshot, WorkerRegistry, WorkerSpec, WorkerState
from scheduler_svc.registry_store import RegistryMirror
from scheduler_svc.worker_client import WorkerChannels
from services.clock import Clock
from services.redis_client import connect

log = logging.getLogger(__name__)


class Scheduler:
    """Registry + routing + admission + Redis links of one scheduler replica."""

    def __init__(self, config: SchedulerConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.registry = WorkerRegistry(
            config.worker_timeout_s,
            config.worker_forget_s,
            config.max_inflight_per_worker,
            clock,
            prefill_decodes=config.pd_prefill_decodes,
        )
        self.index = PrefixIndex(config.speculative_ttl_s, clock=clock)
        self.policy = make_policy(config.routing_policy, self.index, PrefixWeights.of(config))
        self.dispatcher = Dispatcher(
            self.registry, self.policy, config.max_queue_len, config.queue_timeout_s, self._on_dispatch
        )
        self.channels = WorkerChannels(config.max_message_bytes)
        self.leases = LeaseTable(config.lease_ttl_s, config.lease_grace_s, clock)
        self.redis: aioredis.Redis | None = None
        self.subscriber: KvSubscriber | None = None
        self.mirror: RegistryMirror | None = None
        self._dirty: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._seen_version = -1
        self._mirrored_at = -float("inf")

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connects Redis (if configured) and starts the background loops."""
        if self.config.redis_url:
            self.redis = connect(self.config.redis_url)
            self.redis.set_retry(Retry(NoBackoff(), 1))
            self.subscriber = KvSubscriber(self.redis, self.index, self._tracked)
            self.mirror = RegistryMirror(self.redis, self.registry, self.config.worker_forget_s)
            self._tasks.append(asyncio.create_task(self.subscriber.run(), name="kv-subscriber"))
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="scheduler-housekeeping"))
        metrics.REDIS_UP.set(0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.channels.close()
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None

    # -- registry RPCs ----------------------------------------------------------------

    def register(self, spec: WorkerSpec) -> None:
        """RegisterWorker: adds/replaces the worker and (re)loads its prefix index entries."""
        if spec.role in ("decoder", "prefill") and spec.block_size != self.config.block_size:
            log.warning(
                "worker %s uses block_size %d (scheduler default %d); hashing per worker",
                spec.worker_id,
                spec.block_size,
                self.config.block_size,
            )
        _state, is_new = self.registry.register(spec)
        log.info(
            "%s worker %s (%s, model %s) at %s",
            "registered" if is_new else "re-registered",
            spec.worker_id,
            spec.role,
            spec.model,
            spec.address,
        )
        self.index.remove_worker(spec.worker_id)
        if self.subscriber is not None:
            self.subscriber.request_resync(spec.worker_id)
        self._dirty.add(spec.worker_id)
        self._registry_changed()

    def heartbeat(
        self, worker_id: str, load: LoadSnapshot, draining: bool, active_leases: Iterable[str] = ()
    ) -> bool:
        """Heartbeat: records load and ends the worker's leases it no longer runs;
        False when the worker must register again."""
        state = self.registry.get(worker_id)
        was_draining = state is not None and state.draining
        # Leases first: the registry splits the worker's load into this replica's share
        # (its leases) and the rest, so ended leases must be gone when it does.
        if state is not None:
            self.end_leases(self.leases.reconcile(worker_id, active_leases))
        known, revived = self.registry.heartbeat(worker_id, load, draining)
        if not known:
            return False
        if revived:
            log.info("worker %s is back", worker_id)
            if self.subscriber is not None:
                self.subscriber.request_resync(worker_id)
        if draining and not was_draining:
            log.info("worker %s is draining", worker_id)
        self._dirty.add(worker_id)
        self._registry_changed()
        return True

    def _tracked(self, worker_id: str) -> bool:
        state = self.registry.get(worker_id)
        return state is not None and state.healthy

    # -- routing hooks ----------------------------------------------------------------

    def _on_dispatch(self, request: RoutingRequest, decision: Decision) -> None:
        metrics.ROUTED.labels(policy=self.policy.name, reason=decision.reason).inc()
        if decision.total_blocks:
            metrics.PREFIX_HIT.observe(decision.matched_blocks / decision.total_blocks)

    def end_leases(self, ended: list[LeaseRecord]) -> None:
        """Hands the slots of ended leases back (admits queued requests) and counts them
        by how they ended (their end state)."""
        for lease in ended:
            self.dispatcher.release(lease.lease)
            metrics.LEASES_ENDED.labels(how=lease.state.value).inc()
        metrics.LEASES.set(len(self.leases))

    def worker_failed(self, worker_id: str) -> None:
        """A call to the worker failed at the transport level: keep new requests away a while."""
        self.registry.mark_suspect(worker_id, self.config.suspect_penalty_s)

    def _registry_changed(self) -> None:
        if self.registry.version != self._seen_version:
            self._seen_version = self.registry.version
            self.dispatcher.pump()
            metrics.update_worker_gauges(self.registry)

    # -- housekeeping -----------------------------------------------------------------

    async def _housekeeping(self) -> None:
        interval = min(self.config.heartbeat_interval_s / 2, self.config.worker_timeout_s / 4)
        while True:
            try:
                await self.housekeep_once()
            except Exception:
                log.exception("scheduler housekeeping failed")
            await asyncio.sleep(interval)

    async def housekeep_once(self) -> None:
        """One round of sweep, Redis sync (at most once per heartbeat interval), index
        expiry and gauges."""
        self.sweep()
        self.end_leases(self.leases.expire())
        now = self.registry.now()
        if self.mirror is not None and now - self._mirrored_at >= 0.9 * self.config.heartbeat_interval_s:
            # Worker entries change at most once per heartbeat: syncing every sweep round
            # (twice as often) would double an idle replica's Redis calls for nothing.
            self._mirrored_at = now
            await self._sync_mirror()
        self.index.expire()
        metrics.QUEUE_DEPTH.set(len(self.dispatcher.queue))
        metrics.update_worker_gauges(self.registry)

    def sweep(self) -> None:
        """Marks silent workers down and forgets long-gone ones."""
        down, gone = self.registry.sweep()
        for worker_id in down:
            log.warning(
                "worker %s missed heartbeats for %.1fs: marked down", worker_id, self.config.worker_timeout_s
            )
            self.worker_down(worker_id)
        for worker_id in gone:
            log.info("forgetting worker %s", worker_id)
            self.index.remove_worker(worker_id)
            self.channels.drop(worker_id)
            metrics.forget_worker(worker_id)
        self._registry_changed()

    def worker_down(self, worker_id: str) -> None:
        """Drops the worker's index entries and leases (its requests are lost with it)."""
        self.registry.mark_down(worker_id)
        self.index.remove_worker(worker_id)
        self.end_leases(self.leases.of_worker(worker_id))
        self._registry_changed()

    async def _sync_mirror(self) -> None:
        if self.mirror is None:
            return
        dirty, self._dirty = self._dirty, set()
        try:
            learnt = await self.mirror.sync(dirty)
        except (RedisError, OSError) as exc:
            self._dirty |= dirty
            log.debug("registry mirror: Redis unreachable: %s", exc)
            return
        for worker_id in learnt:
            log.info("worker %s learnt from Redis", worker_id)
            self.index.remove_worker(worker_id)
            if self.subscriber is not None:
                self.subscriber.request_resync(worker_id)
        self._registry_changed()

    # -- views ------------------------------------------------------------------------

    def workers(self) -> list[WorkerState]:
        return sorted(self.registry.all(), key=lambda w: w.worker_id)
