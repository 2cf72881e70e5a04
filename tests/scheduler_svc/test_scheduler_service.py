"""Scheduler over real gRPC with fake workers (no Redis): registry RPCs, routes and
releases on a RouteStream and their leases (heartbeat reconciliation, TTL, worker down),
admission (priority, overflow, timeout, cancellation while queued), exclusions for the
gateway's failover, draining, Embed, metrics and the process entry point."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from meshserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.ports import free_port
from services.rpc import check_health
from tests.fake_clock import FakeClock
from tests.fake_worker import FakeWorker
from tests.mesh import metric_value
from tests.scheduler_svc.conftest import RunningScheduler, generate_request
from tests.scheduler_svc.route_client import RouteClient
from tests.worker_svc.worker_kit import generate_one
from worker_svc.registration import SchedulerLink

pytestmark = pytest.mark.timeout(60)
# With a fake scheduler clock: its steps (past a lease grace or TTL) must not also make
# the worker's last heartbeat look stale.
STEADY_WORKERS = {"worker_timeout_s": 60.0, "worker_forget_s": 120.0}


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def rejected(code: str) -> float:
    return metric("meshserve_scheduler_rejected_total", code=code)


async def route_status(sched: RunningScheduler, prompt: list[int], **fields: Any) -> grpc.StatusCode:
    """The status code of a route that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.route(prompt, **fields)
    return info.value.code()


def start_route(sched: RunningScheduler, prompt: list[int], **fields: Any) -> Any:
    """A route left running (it may wait in the admission queue); await it or cancel it."""
    return asyncio.create_task(sched.route(prompt, **fields))


async def test_route_leases_a_worker_and_release_frees_it(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(lease_ttl_s=30)
    worker = await start_worker("w1", sched)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks of 4
    first = await sched.route(prompt, request_id="r1", priority=3, tenant="t")
    assert first.request_id == "r1"
    assert first.worker_id == "w1" and first.worker_address == worker.address
    assert first.lease_id and first.lease_ttl_ms == 30_000
    assert first.reason == "score" and first.predicted_cached_tokens == 0
    assert sched.inflight("w1") == 1 and sched.lease_ids() == {first.lease_id}
    # The scheduler never calls the worker: the caller runs the request there.
    assert worker.started == []
    # A second route of the same prompt expects the prefix its first routing cached there.
    second = await sched.route(prompt)
    assert second.request_id and second.request_id != "r1"
    assert second.lease_id != first.lease_id
    assert second.reason == "prefix" and second.predicted_cached_tokens == 8
    assert sched.inflight("w1") == 2
    assert await sched.release(first.lease_id, "unknown-lease") == 1
    assert sched.inflight("w1") == 1
    assert await sched.release(first.lease_id) == 0  # already ended: no double release
    assert sched.inflight("w1") == 1
    assert await sched.release(second.lease_id) == 1
    assert sched.inflight("w1") == 0 and sched.lease_ids() == set()


async def test_leases_released_along_with_the_next_route(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(lease_ttl_s=30)
    await start_worker("w1", sched)
    first = await sched.route([1, 2, 3], request_id="a")
    second = await sched.route([4, 5, 6], request_id="b")
    assert sched.inflight("w1") == 2
    release = scheduler_pb2.ReleaseRequest(lease_ids=[first.lease_id, second.lease_id, "unknown"])
    third = await sched.routes.route(generate_request([7, 8, 9], request_id="c"), release=release)
    assert sched.lease_ids() == {third.lease_id} and sched.inflight("w1") == 1


async def test_registry_rpcs(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    reply = await sched.stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="ghost"))
    assert not reply.known
    worker = await start_worker("w1", sched)
    await start_worker("e1", sched, model="emb", role="embedding")
    listing = await sched.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
    assert {s.worker.worker_id for s in listing.workers} == {"w1", "e1"}
    assert list(listing.models) == ["emb", "m"]
    assert all(s.healthy and not s.draining for s in listing.workers)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        bad = scheduler_pb2.WorkerDescriptor(
            worker_id="x",
            address="a:1",
            role=99,
            model="m",
            block_size=4,
        )
        await sched.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A silent worker is marked unhealthy and leaves the model list.
    worker.hang()
    await sched.wait_for(lambda: not sched.core.registry.get("w1").healthy)
    listing = await sched.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
    status = next(s for s in listing.workers if s.worker.worker_id == "w1")
    assert not status.healthy and status.last_heartbeat_age_s > 0.5
    assert list(listing.models) == ["emb"]
    worker.resume()
    await sched.wait_for(lambda: sched.core.registry.get("w1").healthy)


async def test_route_errors(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    unavailable, not_found = rejected("UNAVAILABLE"), rejected("NOT_FOUND")
    assert await route_status(sched, [1, 2]) == grpc.StatusCode.UNAVAILABLE  # no workers at all
    await start_worker("w1", sched)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.route([1, 2], model="other")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model 'other'" in (info.value.details() or "")
    assert await route_status(sched, []) == grpc.StatusCode.INVALID_ARGUMENT
    assert await route_status(sched, [1], model="") == grpc.StatusCode.INVALID_ARGUMENT
    assert rejected("UNAVAILABLE") == unavailable + 1 and rejected("NOT_FOUND") == not_found + 1
    assert sched.inflight("w1") == 0 and sched.lease_ids() == set()


async def test_exclude_worker_ids_for_failover(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(routing_policy="round_robin", max_inflight_per_worker=1)
    await start_worker("a", sched)
    await start_worker("b", sched)
    rerouted = metric("meshserve_scheduler_failovers_total", outcome="rerouted")
    for _ in range(3):
        reply = await sched.route([1, 2], exclude=["a"])
        assert reply.worker_id == "b"
        assert await sched.release(reply.lease_id) == 1
    assert metric("meshserve_scheduler_failovers_total", outcome="rerouted") == rerouted + 3
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.route([1, 2], exclude=["a", "b"])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "other than a, b" in (info.value.details() or "")
    # An excluded worker is not used even when it is the only one with a free slot:
    # the request waits for the other one.
    held = await sched.route([3], exclude=["a"])
    assert held.worker_id == "b"
    waiting = start_route(sched, [4], exclude=["a"])
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    assert sched.inflight("a") == 0
    await sched.release(held.lease_id)
    assert (await waiting).worker_id == "b"


async def test_queue_overflow_is_resource_exhausted(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(max_inflight_per_worker=1, max_queue_len=1)
    await start_worker("a", sched)
    held = await sched.route([1])
    queued = start_route(sched, [2])
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    before = rejected("RESOURCE_EXHAUSTED")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.route([3])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in (info.value.details() or "")
    assert rejected("RESOURCE_EXHAUSTED") == before + 1
    await sched.release(held.lease_id)
    assert (await queued).worker_id == "a"


async def test_queue_timeout_is_resource_exhausted(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(max_inflight_per_worker=1, queue_timeout_s=0.3)
    await start_worker("a", sched)
    await sched.route([1])
    before = rejected("RESOURCE_EXHAUSTED")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.route([2])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waited 0.3s in the scheduler queue" in (info.value.details() or "")
    assert rejected("RESOURCE_EXHAUSTED") == before + 1
    assert len(sched.core.dispatcher.queue) == 0 and sched.inflight("a") == 1


def shed(reason: str) -> float:
    return metric("meshserve_scheduler_shed_total", reason=reason)


async def test_a_request_s_class_sets_its_queue_timeout(start_scheduler: Any, start_worker: Any) -> None:
    """queue_timeout_s 0 (a sheddable class): refused at once when no worker is free,
    never queued; a short one times out before the scheduler's own 60 s."""
    sched = await start_scheduler(max_inflight_per_worker=1, queue_timeout_s=60)
    await start_worker("a", sched)
    await sched.route([1], priority=9)  # the top priority: nobody displaces it
    before = shed("no_free_worker")
    started = asyncio.get_running_loop().time()
    assert await route_status(sched, [2], queue_timeout_s=0) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert shed("no_free_worker") == before + 1 and len(sched.core.dispatcher.queue) == 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.route([3], queue_timeout_s=0.3)
    assert "waited 0.3s in the scheduler queue" in (info.value.details() or "")
    assert asyncio.get_running_loop().time() - started < 5
    assert await route_status(sched, [4], queue_timeout_s=-1) == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_full_queue_sheds_its_lowest_priority_for_a_higher_one(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched = await start_scheduler(max_inflight_per_worker=1, max_queue_len=2)
    await start_worker("a", sched)
    held = await sched.route([1], priority=9)
    old_low = start_route(sched, [2], request_id="old-low", priority=-20)
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    new_low = start_route(sched, [3], request_id="new-low", priority=-20)
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 2)
    before = shed("queue_full")
    high = start_route(sched, [4], request_id="high", priority=0)
    with pytest.raises(grpc.aio.AioRpcError) as pushed_out:
        await new_low  # the newest of the lowest priority goes first
    assert pushed_out.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "higher priority took this one's place" in (pushed_out.value.details() or "")
    assert shed("queue_full") == before + 1
    # Full again, of priorities -20 and 0: one no higher than the lowest is refused.
    assert await route_status(sched, [5], priority=-20) == grpc.StatusCode.RESOURCE_EXHAUSTED
    await sched.release(held.lease_id)
    first = await high
    assert first.request_id == "high"
    await sched.release(first.lease_id)
    assert (await old_low).request_id == "old-low"


async def test_queued_route_gets_the_worker_when_a_lease_is_released(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched = await start_scheduler(max_inflight_per_worker=1)
    await start_worker("a", sched)
    wait_count = metric("meshserve_scheduler_queue_wait_seconds_count")
    wait_sum = metric("meshserve_scheduler_queue_wait_seconds_sum")
    held = await sched.route([1])
    assert metric("meshserve_scheduler_queue_wait_seconds_count") == wait_count  # did not wait
    queued = start_route(sched, [2], request_id="queued")
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    await sched.wait_for(lambda: metric("meshserve_scheduler_queue_depth") == 1)
    await asyncio.sleep(0.3)
    assert not queued.done()
    assert await sched.release(held.lease_id) == 1
    reply = await queued
    assert reply.request_id == "queued" and reply.worker_id == "a"
    assert sched.lease_ids() == {reply.lease_id} and sched.inflight("a") == 1
    assert len(sched.core.dispatcher.queue) == 0
    # QUEUE_WAIT observed the request that waited, for about as long as it waited.
    assert metric("meshserve_scheduler_queue_wait_seconds_count") == wait_count + 1
    assert metric("meshserve_scheduler_queue_wait_seconds_sum") - wait_sum >= 0.3


async def test_queued_routes_are_admitted_by_priority(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(max_inflight_per_worker=1)
    await start_worker("a", sched)
    held = await sched.route([1], priority=9)  # the top priority: nobody displaces it
    low = start_route(sched, [2], request_id="low", priority=0)
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    high = start_route(sched, [3], request_id="high", priority=5)
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 2)
    await sched.release(held.lease_id)
    first = await high
    assert first.request_id == "high"
    await asyncio.sleep(0.1)
    assert not low.done()
    await sched.release(first.lease_id)
    assert (await low).request_id == "low"


async def test_cancelled_queued_route_leaves_the_queue(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(max_inflight_per_worker=1)
    await start_worker("a", sched)
    held = await sched.route([1])
    queued = start_route(sched, [2], request_id="gone")
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    queued.cancel()
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 0)
    await sched.wait_for(lambda: metric("meshserve_scheduler_queue_depth") == 0)
    # The slot is not leaked to the cancelled request: releasing the held lease frees the
    # worker entirely and the next route is placed at once.
    assert await sched.release(held.lease_id) == 1
    assert sched.inflight("a") == 0 and sched.lease_ids() == set()
    reply = await sched.route([3], timeout=2)
    assert reply.worker_id == "a" and sched.inflight("a") == 1


async def test_heartbeats_end_leases_their_worker_no_longer_runs(
    start_scheduler: Any, start_worker: Any
) -> None:
    clock = FakeClock()
    sched = await start_scheduler(clock, lease_grace_s=1.0, **STEADY_WORKERS)
    worker = await start_worker("a", sched)
    kept = await sched.route([1])
    dropped = await sched.route([2])
    # Inside the grace period a lease is kept although the worker does not report it
    # (its request may still be on the way to the worker).
    clock.advance(0.9)
    await sched.wait_heartbeat("a")
    await worker.wait_beats(2)
    assert sched.lease_ids() == {kept.lease_id, dropped.lease_id} and sched.inflight("a") == 2
    # Past the grace, only the leases the worker reports survive its heartbeats.
    worker.lease_ids = {kept.lease_id}
    await worker.wait_beats(2)  # reports listing it reached the scheduler
    clock.advance(0.2)
    await sched.wait_for(lambda: sched.lease_ids() == {kept.lease_id})
    assert sched.inflight("a") == 1
    assert await sched.release(dropped.lease_id) == 0  # the worker's report ended it
    await worker.wait_beats(3)
    assert sched.lease_ids() == {kept.lease_id}


async def test_lease_of_a_running_request_lasts_until_it_ends(
    start_scheduler: Any, start_worker: Any
) -> None:
    """No release at all (the gateway died): the worker's reports keep the lease while
    its request runs and end it once the request has finished."""
    clock = FakeClock()
    sched = await start_scheduler(clock, lease_grace_s=1.0, **STEADY_WORKERS)
    worker = await start_worker("a", sched, tokens=3)
    worker.finish.clear()  # the request runs until the test lets it finish
    route = await sched.route([1, 2, 3])
    request = generate_request([1, 2, 3], request_id=route.request_id, lease_id=route.lease_id)
    async with grpc.aio.insecure_channel(route.worker_address) as channel:
        stream = generate_one(worker_pb2_grpc.WorkerStub(channel), request, timeout=20)
        first = await anext(stream)
        assert first.worker_id == "a" and worker.active_lease_ids() == [route.lease_id]
        for _ in range(3):  # past the grace, several heartbeats
            clock.advance(0.6)
            await sched.wait_heartbeat("a")
        assert sched.lease_ids() == {route.lease_id} and sched.inflight("a") == 1
        worker.finish.set()
        last = first
        async for message in stream:
            last = message
        assert last.finished
    await worker.wait_beats(2)  # the second was sent after the request ended
    assert sched.lease_ids() == {route.lease_id}  # unreported for less than the grace
    clock.advance(1.5)
    await sched.wait_for(lambda: sched.lease_ids() == set())
    assert sched.inflight("a") == 0


async def test_lease_ttl_frees_the_slot(start_scheduler: Any, start_worker: Any) -> None:
    clock = FakeClock()
    sched = await start_scheduler(
        clock, max_inflight_per_worker=1, lease_ttl_s=0.5, lease_grace_s=60, **STEADY_WORKERS
    )
    await start_worker("a", sched)
    held = await sched.route([1])
    assert held.lease_ttl_ms == 500
    queued = start_route(sched, [2])
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    clock.advance(0.4)
    await sched.core.housekeep_once()
    assert held.lease_id in sched.lease_ids() and len(sched.core.dispatcher.queue) == 1
    clock.advance(0.2)
    reply = await asyncio.wait_for(queued, 20)  # admitted once the first lease expired
    assert reply.worker_id == "a" and held.lease_id not in sched.lease_ids()
    assert await sched.release(held.lease_id) == 0


async def test_worker_marked_down_loses_its_leases(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(routing_policy="round_robin", lease_grace_s=60)
    worker = await start_worker("a", sched)
    await start_worker("b", sched)
    leases = [await sched.route([i]) for i in range(4)]
    assert {r.worker_id for r in leases} == {"a", "b"}
    on_a = {r.lease_id for r in leases if r.worker_id == "a"}
    on_b = {r.lease_id for r in leases if r.worker_id == "b"}
    worker.lease_ids = set(on_a)
    worker.hang()  # a hung worker: its heartbeats stop
    await sched.wait_for(lambda: not sched.core.registry.get("a").healthy)
    assert sched.lease_ids() == on_b
    assert sched.inflight("a") == 0 and sched.inflight("b") == 2
    assert await sched.release(*on_a) == 0
    for _ in range(3):
        reply = await sched.route([9])
        assert reply.worker_id == "b"
        await sched.release(reply.lease_id)
    # Back: routable again, with no stale slots taken.
    worker.resume()
    await sched.wait_for(lambda: sched.core.registry.get("a").healthy)
    assert sched.inflight("a") == 0


async def test_killed_worker_stops_getting_routes(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(routing_policy="round_robin")
    victim = await start_worker("a", sched)
    await start_worker("b", sched)
    await victim.kill()
    await sched.wait_for(lambda: not sched.core.registry.get("a").healthy)
    for _ in range(4):
        reply = await sched.route([1])
        assert reply.worker_id == "b"
        await sched.release(reply.lease_id)


async def test_draining_worker_gets_no_new_routes(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(routing_policy="round_robin")
    draining = await start_worker("a", sched)
    other = await start_worker("b", sched)
    draining.draining = True
    await sched.wait_for(lambda: sched.core.registry.get("a").draining)
    for _ in range(4):
        reply = await sched.route([1])
        assert reply.worker_id == "b"
        await sched.release(reply.lease_id)
    other.draining = True
    await sched.wait_for(lambda: sched.core.registry.get("b").draining)
    assert await route_status(sched, [1]) == grpc.StatusCode.UNAVAILABLE


async def test_worker_heartbeating_two_replicas(start_scheduler: Any, start_worker: Any) -> None:
    """A worker given two scheduler addresses (no Redis) registers with both; each replica
    reconciles its own leases against the worker's one list."""
    clock = FakeClock()
    first = await start_scheduler(clock, lease_grace_s=1.0, **STEADY_WORKERS)
    second = await start_scheduler(clock, lease_grace_s=1.0, **STEADY_WORKERS)
    worker: FakeWorker = await start_worker("w")  # serves, but heartbeats through the link
    load = worker_pb2.LoadStats(num_total_blocks=1000)
    link = SchedulerLink(
        f"{first.address},{second.address}", worker.descriptor(), lambda: load, worker.active_lease_ids
    )
    link.start()
    try:
        for sched in (first, second):
            await sched.wait_for(lambda s=sched: s.core.registry.get("w") is not None)
        on_first = await first.route([1])
        worker.lease_ids.add(on_first.lease_id)
        on_second = await second.route([2])
        worker.lease_ids.add(on_second.lease_id)
        assert on_first.worker_id == on_second.worker_id == "w"
        await beats_after(clock, 0.5, first, second)  # any report sent before the leases: handled
        await beats_after(clock, 1.0, first, second)  # past the grace
        assert first.lease_ids() == {on_first.lease_id} and second.lease_ids() == {on_second.lease_id}
        worker.lease_ids = {on_first.lease_id}  # the second replica's request ended
        await beats_after(clock, 0.5, first, second)
        await beats_after(clock, 1.0, first, second)
        await second.wait_for(lambda: second.lease_ids() == set())
        assert second.inflight("w") == 0
        assert first.lease_ids() == {on_first.lease_id} and first.inflight("w") == 1
    finally:
        await link.close()


async def beats_after(clock: FakeClock, seconds: float, *schedulers: RunningScheduler) -> None:
    """Advances the schedulers' clock, then waits for a worker heartbeat on each (heartbeats
    go one at a time: any sent before this call is handled by the end of it)."""
    clock.advance(seconds)
    for sched in schedulers:
        await sched.wait_heartbeat("w")


async def test_embed_routing_and_failover(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(routing_policy="round_robin")
    await start_worker("d1", sched)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.stub.Embed(common_pb2.EmbedRequest(model="m", inputs=["x"]))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no embedding worker at all
    broken = await start_worker("e1", sched, model="emb", role="embedding")
    healthy = await start_worker("e2", sched, model="emb", role="embedding")
    broken.fail_first = True
    reply = await sched.stub.Embed(
        common_pb2.EmbedRequest(request_id="x1", model="emb", inputs=["ab", "abc"])
    )
    assert [list(e.values) for e in reply.embeddings] == [[2.0, 1.0], [3.0, 1.0]]
    assert broken.started == ["x1"] and healthy.started == ["x1"]  # tried e1, failed over to e2
    assert sched.inflight("e1") == 0 and sched.inflight("e2") == 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.stub.Embed(common_pb2.EmbedRequest(model="nope", inputs=["x"]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_worker_gauges(start_scheduler: Any, start_worker: Any) -> None:
    def gauge(health: str) -> float:
        return metric("meshserve_scheduler_workers", role="decoder", health=health)

    def inflight() -> float:
        return metric("meshserve_scheduler_worker_inflight", worker_id="g1")

    sched = await start_scheduler()
    worker = await start_worker("g1", sched)
    await sched.wait_for(lambda: gauge("healthy") == 1)
    reply = await sched.route([1])
    await sched.wait_for(lambda: inflight() == 1)
    await sched.release(reply.lease_id)
    await sched.wait_for(lambda: inflight() == 0)
    worker.draining = True
    await sched.wait_for(lambda: gauge("draining") == 1 and gauge("healthy") == 0)
    worker.hang()
    await sched.wait_for(lambda: gauge("unhealthy") == 1 and gauge("draining") == 0)


async def test_process_entry_point_serves_and_drains() -> None:
    port, metrics_port = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler_svc", "--port", str(port), "--routing-policy", "least_load",
        "--metrics-port", str(metrics_port),
        env={**os.environ, "MESHSERVE_DRAIN_TIMEOUT_S": "1"},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while not await check_health(f"127.0.0.1:{port}", "meshserve.v1.Scheduler"):
            assert proc.returncode is None, "scheduler exited"
            assert asyncio.get_running_loop().time() < deadline, "scheduler did not become healthy"
            await asyncio.sleep(0.1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            descriptor = scheduler_pb2.WorkerDescriptor(
                worker_id="p1", address="127.0.0.1:1", model="m", block_size=16, max_num_seqs=2
            )
            reply = await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=descriptor))
            assert reply.heartbeat_interval_ms == 500
            listing = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
            assert [s.worker.worker_id for s in listing.workers] == ["p1"]
            routes = RouteClient(channel)
            route = await routes.route(generate_request([1, 2, 3]), timeout=5)
            assert route.worker_id == "p1" and route.worker_address == "127.0.0.1:1"
            assert route.reason == "least_load" and route.lease_ttl_ms == 600_000
            routes.release(route.lease_id)
            await routes.close()
        assert await released(metrics_port, 1) == 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def released(metrics_port: int, count: int, timeout: float = 10.0) -> float:
    """The process's leases ended by a release, once there are `count` (or at the timeout)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await asyncio.to_thread(
            metric_value, metrics_port, "meshserve_scheduler_leases_ended_total", how="released"
        )
        if value >= count or asyncio.get_running_loop().time() > deadline:
            return value
        await asyncio.sleep(0.05)
