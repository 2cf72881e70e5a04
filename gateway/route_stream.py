"""The gateway's end of `Scheduler.RouteStream`: ONE long-lived stream per scheduler
replica, shared by every request this gateway process routes there.

Each route is a message with a call id, answered by a message with the same id, in
completion order; releases ride on the route messages (or go alone when no route is
due). Why not a unary Route per request: on the replica a stream message costs about a
third of a unary call's CPU, and the round trip is about half as long (bench/README.md).

A route that fails raises the `grpc.aio.AioRpcError` the unary Route would have raised
(same code, message and `param` metadata), so failover between replicas and the mapping
to HTTP stay the same. A broken stream fails every route waiting on it with its error
(UNAVAILABLE when the replica died: the caller tries the next replica); the next route
opens a new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.rpc import PARAM_METADATA_KEY

log = logging.getLogger(__name__)

_Outgoing = asyncio.Queue[scheduler_pb2.RouteStreamRequest | None]


def _rpc_error(code: grpc.StatusCode, message: str, param: str = "") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((PARAM_METADATA_KEY, param)) if param else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


class RouteStream:
    """One RouteStream call to one replica (reopened after a break) and its routes in flight."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, name: str) -> None:
        self._stub = stub
        self._name = name
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[scheduler_pb2.RouteResponse]] = {}
        self._outgoing: _Outgoing | None = None
        self._reader: asyncio.Task[None] | None = None

    async def route(
        self, message: scheduler_pb2.RouteStreamRequest, timeout: float
    ) -> scheduler_pb2.RouteResponse:
        """Sends `message` (its `route`, and any releases on it) with a fresh call id and
        waits for the answer. Cancelling the wait cancels the route on the replica."""
        outgoing = self._open()
        call_id = next(self._ids)
        message.call_id = call_id
        future: asyncio.Future[scheduler_pb2.RouteResponse] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        outgoing.put_nowait(message)
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            self._cancel(call_id)
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self._cancel(call_id)
            raise
        finally:
            self._pending.pop(call_id, None)

    def release(self, release: scheduler_pb2.ReleaseRequest) -> None:
        """Sends leases to release on their own message (no route due to carry them)."""
        self._open().put_nowait(scheduler_pb2.RouteStreamRequest(release=release))

    def _cancel(self, call_id: int) -> None:
        if self._outgoing is not None and call_id in self._pending:
            self._outgoing.put_nowait(scheduler_pb2.RouteStreamRequest(cancel_call_ids=[call_id]))

    def _open(self) -> _Outgoing:
        if self._outgoing is not None and self._reader is not None and not self._reader.done():
            return self._outgoing
        outgoing: _Outgoing = asyncio.Queue()
        # No deadline: the stream outlives routes (each route has its own timeout).
        call = self._stub.RouteStream(_messages(outgoing))
        self._outgoing = outgoing
        self._reader = asyncio.create_task(self._read(call, outgoing), name=f"route-stream-{self._name}")
        return outgoing

    async def _read(self, call: grpc.aio.StreamStreamCall, outgoing: _Outgoing) -> None:
        error = _rpc_error(grpc.StatusCode.UNAVAILABLE, f"scheduler {self._name} ended the route stream")
        try:
            async for answer in call:
                self._answer(answer)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            call.cancel()
        finally:
            outgoing.put_nowait(None)
            if self._outgoing is outgoing:
                self._outgoing = None
            pending, self._pending = self._pending, {}
            if pending:
                log.warning(
                    "route stream to %s lost with %d routes: %s", self._name, len(pending), error.code()
                )
            for future in pending.values():
                if not future.done():
                    future.set_exception(error)

    def _answer(self, answer: scheduler_pb2.RouteStreamResponse) -> None:
        future = self._pending.get(answer.call_id)
        if future is None or future.done():  # the caller gave up on it
            return
        if answer.HasField("route"):
            future.set_result(answer.route)
            return
        code = _STATUS_BY_NUMBER.get(answer.error.code, grpc.StatusCode.UNKNOWN)
        future.set_exception(_rpc_error(code, answer.error.message, answer.error.param))

    async def close(self, timeout: float = 1.0) -> None:
        """Half-closes the stream after what is queued (releases) and waits for its end."""
        if self._outgoing is not None:
            self._outgoing.put_nowait(None)
        if self._reader is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._reader), timeout)
            self._reader.cancel()


async def _messages(outgoing: _Outgoing) -> AsyncIterator[scheduler_pb2.RouteStreamRequest]:
    while (message := await outgoing.get()) is not None:
        yield message
