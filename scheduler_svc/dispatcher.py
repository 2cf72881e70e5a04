"""Admission + routing: turns a request into a lease on one worker, or queues it.

Domain code (asyncio, no grpc). `acquire` places the request at once when nobody is
waiting and a worker has capacity; otherwise it waits in the `AdmissionQueue` until
`release` (or a registry change) frees capacity, the queue timeout passes, or the request
is aborted. Requests for a model no worker serves fail with `NotFound`; requests for a
model whose workers are all down or draining fail with `Unavailable`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from scheduler_svc import metrics
from scheduler_svc.admission import AdmissionQueue
from scheduler_svc.policies import Decision, RoutingPolicy, RoutingRequest
from scheduler_svc.registry import Lease, WorkerRegistry, WorkerState
from services.errors import NotFound, Overloaded, Unavailable

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Waiter:
    """A request waiting in the admission queue."""

    request: RoutingRequest
    exclude: frozenset[str]
    future: asyncio.Future[tuple[Lease, Decision]] = field(repr=False)

    def group(self) -> Hashable:
        return (self.request.model, self.request.role, self.exclude)


DispatchHook = Callable[[RoutingRequest, Decision], None]


class Dispatcher:
    """Places requests on workers: admission queue in front of a routing policy."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policy: RoutingPolicy,
        max_queue_len: int,
        queue_timeout_s: float,
        on_dispatch: DispatchHook | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.queue: AdmissionQueue[Waiter] = AdmissionQueue(max_queue_len)
        self._queue_timeout_s = queue_timeout_s
        self._on_dispatch = on_dispatch
        self._waiting: dict[str, Waiter] = {}

    def check_model(self, model: str, role: str = "decoder", exclude: frozenset[str] = frozenset()) -> None:
        """Raises NotFound when nobody serves `model`, Unavailable when nobody can take it now."""
        if not any(w.spec.role == role for w in self.registry.all()):
            raise Unavailable(f"no {role} workers are registered with the scheduler")
        if not self.registry.serving(model, role):
            known = ", ".join(self.registry.models(healthy_only=False)) or "none"
            noun = "model" if role == "decoder" else f"{role} model"
            raise NotFound(f"{noun} '{model}' is not served (served models: {known})", param="model")
        if not self.registry.candidates(model, role, exclude):
            detail = " other than " + ", ".join(sorted(exclude)) if exclude else ""
            raise Unavailable(f"no healthy {role} worker{detail} for model '{model}'")

    def acquire_now(
        self, request: RoutingRequest, exclude: frozenset[str] = frozenset()
    ) -> tuple[Lease, Decision] | None:
        """A lease when a worker can take `request` now and nobody waits before it;
        None when it would have to queue (then `acquire`). Errors as `acquire`."""
        candidates = self.registry.candidates(request.model, request.role, exclude)
        if not candidates:
            self.check_model(request.model, request.role, exclude)  # raises the precise error
        if len(self.queue) == 0:
            return self._place(request, exclude, candidates)
        return None

    async def acquire(
        self, request: RoutingRequest, exclude: frozenset[str] = frozenset(), *, retry: bool = False
    ) -> tuple[Lease, Decision]:
        """A lease on the worker chosen for `request`, waiting in the queue if needed."""
        placed = self.acquire_now(request, exclude)
        if placed is not None:
            return placed
        if request.queue_timeout_s == 0 and not retry:
            metrics.SHED.labels(reason="no_free_worker").inc()
            raise Overloaded("no worker can take this request now and its class never waits (sheddable)")
        loop = asyncio.get_running_loop()
        waiter = Waiter(request, exclude, loop.create_future())
        evicted = self.queue.push(waiter, request.priority, request.tenant, front=retry)
        if evicted is not None and not evicted.future.done():
            metrics.SHED.labels(reason="queue_full").inc()
            evicted.future.set_exception(
                Overloaded(
                    "the scheduler queue is full and a request of higher priority took this one's place"
                )
            )
        self._waiting[request.request_id] = waiter
        self.pump()
        queued_at = time.perf_counter()
        try:
            await self._wait(waiter)
        except BaseException:
            self._abandon(waiter, release=True)
            raise
        finally:
            metrics.QUEUE_WAIT.observe(time.perf_counter() - queued_at)
        self._abandon(waiter, release=False)
        return waiter.future.result()

    async def _wait(self, waiter: Waiter) -> None:
        if waiter.future.done():
            return
        timeout = waiter.request.queue_timeout_s
        if timeout is None:
            timeout = self._queue_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(waiter.future)
        except TimeoutError:
            if waiter.future.done():
                return
            raise Overloaded(
                f"request waited {timeout:g}s in the scheduler queue without a free worker"
            ) from None

    def release(self, lease: Lease) -> None:
        """Hands a lease back (request finished or failed) and admits waiting requests."""
        self.registry.release(lease)
        if len(self.queue):
            self.pump()

    def pump(self) -> int:
        """Dispatches every waiting request that can run now; returns how many left the queue."""
        if not len(self.queue):
            return 0
        return self.queue.drain(self._take, Waiter.group)

    def _place(
        self,
        request: RoutingRequest,
        exclude: frozenset[str],
        routable: list[WorkerState] | None = None,
    ) -> tuple[Lease, Decision] | None:
        if routable is None:
            routable = self.registry.candidates(request.model, request.role, exclude)
        if request.only_role:
            routable = [w for w in routable if w.spec.role == request.only_role] or routable
        candidates = [w for w in routable if w.has_capacity()]
        if not candidates:  # a higher priority may still displace a lower one (can_displace)
            candidates = [w for w in routable if w.can_displace(request.priority)]
        if not candidates:
            return None
        started = time.perf_counter()
        decision = self.policy.choose(request, candidates)
        metrics.POLICY_SECONDS.labels(policy=self.policy.name).observe(time.perf_counter() - started)
        if request.adapter:
            resident = decision.worker.adapter_resident(request.adapter)
            metrics.ADAPTER_ROUTES.labels(adapter=request.adapter, resident=str(resident).lower()).inc()
        lease = self.registry.acquire(decision.worker, request.adapter, request.priority)
        if self._on_dispatch is not None:
            self._on_dispatch(request, decision)
        return lease, decision

    def _take(self, waiter: Waiter) -> bool:
        if waiter.future.done():
            return True
        try:
            self.check_model(waiter.request.model, waiter.request.role, waiter.exclude)
        except (NotFound, Unavailable) as exc:
            waiter.future.set_exception(exc)
            return True
        placed = self._place(waiter.request, waiter.exclude)
        if placed is None:
            return False
        waiter.future.set_result(placed)
        return True

    def _abandon(self, waiter: Waiter, *, release: bool) -> None:
        """Cleans up after a waiter; with `release`, a lease nobody will use goes back."""
        self.queue.remove(waiter)
        if self._waiting.get(waiter.request.request_id) is waiter:
            del self._waiting[waiter.request.request_id]
        future = waiter.future
        if not future.done():
            future.cancel()
        elif release and not future.cancelled() and future.exception() is None:
            lease, _ = future.result()
            self.release(lease)
