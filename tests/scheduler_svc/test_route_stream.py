"""`Scheduler.RouteStream` over real gRPC with fake workers: many routes on one stream,
answered by call id in completion order; errors per route; releases and cancellations
on the stream; half-close and draining end it without losing a lease or a queue slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from meshserve.v1 import scheduler_pb2
from tests.scheduler_svc.conftest import RunningScheduler, generate_request

pytestmark = pytest.mark.timeout(60)


class Stream:
    """One RouteStream call: send messages, read answers by call id."""

    def __init__(self, sched: RunningScheduler) -> None:
        self.outgoing: asyncio.Queue[scheduler_pb2.RouteStreamRequest | None] = asyncio.Queue()
        self.call = sched.stub.RouteStream(self._messages())
        self.answers: dict[int, scheduler_pb2.RouteStreamResponse] = {}
        self.order: list[int] = []

    async def _messages(self) -> AsyncIterator[scheduler_pb2.RouteStreamRequest]:
        while (message := await self.outgoing.get()) is not None:
            yield message

    def route(self, call_id: int, prompt: list[int], **fields: Any) -> None:
        route = scheduler_pb2.RouteRequest(request=generate_request(prompt, **fields))
        self.answers.pop(call_id, None)  # a reused call id: wait for its new answer
        self.outgoing.put_nowait(scheduler_pb2.RouteStreamRequest(call_id=call_id, route=route))

    def send(self, **fields: Any) -> None:
        self.outgoing.put_nowait(scheduler_pb2.RouteStreamRequest(**fields))

    async def read(self, *call_ids: int) -> list[scheduler_pb2.RouteStreamResponse]:
        """Reads until every one of `call_ids` is answered; their answers."""
        async with asyncio.timeout(10):
            while not all(c in self.answers for c in call_ids):
                answer = await self.call.read()
                assert answer is not grpc.aio.EOF, "the stream ended"
                self.answers[answer.call_id] = answer
                self.order.append(answer.call_id)
        return [self.answers[c] for c in call_ids]

    async def ended(self) -> grpc.StatusCode:
        """Waits for the server to end the stream (no further answer); its status."""
        async with asyncio.timeout(10):
            assert await self.call.read() is grpc.aio.EOF
        code: grpc.StatusCode = await self.call.code()
        return code


async def test_routes_and_per_route_errors_share_one_stream(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    worker = await start_worker("w1", sched)
    stream = Stream(sched)
    stream.route(1, [1, 2, 3, 4, 5], request_id="a")
    stream.route(2, [1, 2], model="nope")
    stream.route(3, [])
    stream.route(4, [9, 9, 9], request_id="b")
    a, unknown, empty, b = await stream.read(1, 2, 3, 4)
    assert a.route.request_id == "a" and a.route.worker_address == worker.address
    assert unknown.error.code == grpc.StatusCode.NOT_FOUND.value[0] and unknown.error.param == "model"
    assert empty.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and empty.error.param == "prompt"
    assert b.route.request_id == "b" and b.route.lease_id != a.route.lease_id
    assert sched.lease_ids() == {a.route.lease_id, b.route.lease_id} and sched.inflight("w1") == 2
    # A call id may be reused once its route is answered.
    stream.send(release=scheduler_pb2.ReleaseRequest(lease_ids=[a.route.lease_id, b.route.lease_id]))
    await sched.wait_for(lambda: sched.inflight("w1") == 0 and not sched.lease_ids())
    stream.route(1, [7, 7])
    (again,) = await stream.read(1)
    assert again.HasField("route")
    stream.outgoing.put_nowait(None)
    assert await stream.ended() == grpc.StatusCode.OK


async def test_queued_route_holds_back_no_other_and_can_be_cancelled(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched = await start_scheduler(max_inflight_per_worker=1)
    await start_worker("a", sched)
    stream = Stream(sched)
    stream.route(1, [1], request_id="held")
    (held,) = await stream.read(1)
    stream.route(2, [2], request_id="queued")
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    # The same call id while 2 is in flight: refused alone, 2 keeps waiting.
    stream.route(2, [5])
    duplicate = await stream.call.read()
    assert duplicate.call_id == 2 and duplicate.error.param == "call_id"
    assert len(sched.core.dispatcher.queue) == 1
    stream.route(3, [3], model="nope")  # answered while 2 waits
    (unknown,) = await stream.read(3)
    assert unknown.HasField("error") and 2 not in stream.answers
    # A release on the stream frees the slot: the queued route gets the worker.
    stream.send(release=scheduler_pb2.ReleaseRequest(lease_ids=[held.route.lease_id]))
    (queued,) = await stream.read(2)
    assert queued.route.request_id == "queued" and sched.lease_ids() == {queued.route.lease_id}
    # A cancelled route leaves the queue and is answered CANCELLED; no slot is leaked.
    stream.route(4, [4], request_id="gone")
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    stream.send(cancel_call_ids=[4])
    (gone,) = await stream.read(4)
    assert gone.error.code == grpc.StatusCode.CANCELLED.value[0]
    assert len(sched.core.dispatcher.queue) == 0 and sched.inflight("a") == 1
    stream.send(release=scheduler_pb2.ReleaseRequest(lease_ids=[queued.route.lease_id]))
    await sched.wait_for(lambda: sched.inflight("a") == 0 and not sched.lease_ids())


async def _one_held_one_queued(
    start_scheduler: Any, start_worker: Any
) -> tuple[RunningScheduler, Stream, scheduler_pb2.RouteStreamResponse]:
    """A worker with one slot, a stream holding it (route 1) and route 2 queued."""
    sched = await start_scheduler(max_inflight_per_worker=1)
    await start_worker("a", sched)
    stream = Stream(sched)
    stream.route(1, [1])
    (held,) = await stream.read(1)
    stream.route(2, [2])
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    return sched, stream, held


async def test_half_close_cancels_waiting_routes(start_scheduler: Any, start_worker: Any) -> None:
    sched, stream, held = await _one_held_one_queued(start_scheduler, start_worker)
    stream.outgoing.put_nowait(None)
    assert await stream.ended() == grpc.StatusCode.OK
    assert 2 not in stream.answers and len(sched.core.dispatcher.queue) == 0
    assert sched.lease_ids() == {held.route.lease_id} and sched.inflight("a") == 1


async def test_draining_replica_refuses_new_routes_and_ends_the_stream(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched, stream, held = await _one_held_one_queued(start_scheduler, start_worker)
    await sched.servicer.on_drain()
    stream.route(3, [3])
    (refused,) = await stream.read(3)
    assert refused.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    # The queued route is still answered before the stream ends.
    stream.send(release=scheduler_pb2.ReleaseRequest(lease_ids=[held.route.lease_id]))
    (queued,) = await stream.read(2)
    assert queued.HasField("route")
    assert await stream.ended() == grpc.StatusCode.OK
