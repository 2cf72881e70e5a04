"""Dispatcher: immediate placement, queueing until capacity, overflow, timeouts, aborts."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.dispatcher import Dispatcher
from scheduler_svc.policies import LeastLoadPolicy, RoutingRequest
from scheduler_svc.registry import WorkerRegistry, WorkerSpec
from services.errors import NotFound, Overloaded, Unavailable


def setup(workers: int = 1, capacity: int = 1, queue: int = 4, timeout: float = 5.0) -> Dispatcher:
    registry = WorkerRegistry(timeout_s=3.0, forget_s=30.0)
    for i in range(workers):
        registry.register(WorkerSpec(f"w{i}", f"a:{i}", "decoder", "m", 512, 16, 10, capacity))
    return Dispatcher(registry, LeastLoadPolicy(), queue, timeout)


def req(rid: str, priority: int = 0, tenant: str = "", model: str = "m") -> RoutingRequest:
    return RoutingRequest(rid, model, priority=priority, tenant=tenant)


async def test_unknown_model_and_no_healthy_worker() -> None:
    d = setup()
    with pytest.raises(NotFound, match="model 'nope' is not served") as info:
        await d.acquire(req("r", model="nope"))
    assert info.value.param == "model"
    d.registry.mark_down("w0")
    with pytest.raises(Unavailable, match="no healthy decoder worker"):
        await d.acquire(req("r"))


async def test_queue_until_release_in_priority_order() -> None:
    d = setup(capacity=1)
    lease, _ = await d.acquire(req("first", 9))  # the top priority: nobody displaces it
    order: list[str] = []

    async def wait(rid: str, priority: int) -> None:
        got, _ = await d.acquire(req(rid, priority))
        order.append(rid)
        await asyncio.sleep(0)
        d.release(got)

    tasks = [asyncio.create_task(wait("low", 0)), asyncio.create_task(wait("high", 9))]
    await asyncio.sleep(0.01)
    assert len(d.queue) == 2
    d.release(lease)
    await asyncio.gather(*tasks)
    assert order == ["high", "low"]
    assert d.registry.get("w0").inflight == 0  # type: ignore[union-attr]


async def test_higher_priority_goes_past_a_full_worker_of_lower_ones() -> None:
    """A full worker still takes a request of higher priority than some of ours there
    (its engine preempts one of them), as long as the requests of that priority or
    higher fit its capacity; equal priorities queue."""
    d = setup(capacity=2)
    for rid in ("low-1", "low-2"):
        await d.acquire(req(rid, 0))
    assert d.acquire_now(req("same", 0)) is None  # full: it would queue
    high = [d.acquire_now(req(f"high-{i}", 5)) for i in range(3)]
    assert high[0] is not None and high[1] is not None and high[2] is None  # 2 of capacity 2
    worker = d.registry.get("w0")
    assert worker is not None and worker.inflight == 4 and worker.priority_inflight == {0: 2, 5: 2}
    for placed in high[:2]:
        assert placed is not None
        d.release(placed[0])
    assert worker.priority_inflight == {0: 2}
    assert d.acquire_now(req("top", 9)) is not None


async def test_overflow_raises_overloaded() -> None:
    d = setup(capacity=1, queue=1)
    await d.acquire(req("running"))
    waiting = asyncio.create_task(d.acquire(req("queued")))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded, match="queue is full"):
        await d.acquire(req("rejected"))
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(d.queue) == 0


async def test_queue_timeout() -> None:
    d = setup(capacity=1, timeout=0.05)
    await d.acquire(req("running"))
    with pytest.raises(Overloaded, match="waited"):
        await d.acquire(req("slow"))
    assert len(d.queue) == 0


async def test_waiters_fail_when_the_last_worker_goes_down() -> None:
    d = setup(capacity=1)
    await d.acquire(req("running"))
    waiting = asyncio.create_task(d.acquire(req("queued")))
    await asyncio.sleep(0.01)
    d.registry.mark_down("w0")
    d.pump()
    with pytest.raises(Unavailable):
        await waiting


async def test_cancelled_waiter_returns_its_lease() -> None:
    d = setup(capacity=1)
    lease, _ = await d.acquire(req("running"))
    waiting = asyncio.create_task(d.acquire(req("queued")))
    await asyncio.sleep(0.01)
    d.release(lease)  # the waiter gets the lease...
    waiting.cancel()  # ...but is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert d.registry.get("w0").inflight == 0  # type: ignore[union-attr]


async def test_retry_excludes_failed_worker() -> None:
    d = setup(workers=2, capacity=4)
    lease, _ = await d.acquire(req("r"), exclude=frozenset({"w0"}), retry=True)
    assert lease.worker.worker_id == "w1"
    with pytest.raises(Unavailable, match="other than w0, w1"):
        await d.acquire(req("r2"), exclude=frozenset({"w0", "w1"}), retry=True)
