"""The gateway's end of `Scheduler.RouteStream`: ONE long-lived stream per scheduler
replica, shared by every request this gateway process routes there.

Each route is a message with a call id, answered by a message with the same id, in
completion order; releases ride on the route messages (or go alone when no route is
due). Why not a unary call per request: on the replica a stream message costs about a
third of a unary call's CPU, and the round trip is about half as long (docs/design-decisions.md, "Routes over one stream per
gateway, every request routed").

A route that fails raises a `grpc.aio.AioRpcError` with the RouteError's code, message
and `param` metadata, as any scheduler call fails, so failover between replicas and the
mapping to HTTP are those of every call. A broken stream fails every route waiting on it with its error
(UNAVAILABLE when the replica died: the caller tries the next replica); the next route
opens a new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import grpc

from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.rpc import PARAM_METADATA_KEY

log = logging.getLogger(__name__)


def _rpc_error(code: grpc.StatusCode, message: str, param: str = "") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((PARAM_METADATA_KEY, param)) if param else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


class RouteStream:
    """One RouteStream call to one replica (reopened after a break) and its routes in
    flight. Messages are written with `call.write` by the coroutine that has them (one
    write at a time), not through a request iterator: no queue and no task between a
    route and the wire."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, name: str) -> None:
        self._stub = stub
        self._name = name
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[scheduler_pb2.RouteResponse]] = {}
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._writes = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()

    async def route(
        self, message: scheduler_pb2.RouteStreamRequest, timeout: float
    ) -> scheduler_pb2.RouteResponse:
        """Sends `message` (its `route`, and any releases on it) with a fresh call id and
        waits for the answer. Cancelling the wait cancels the route on the replica."""
        call = self._open()
        call_id = next(self._ids)
        message.call_id = call_id
        future: asyncio.Future[scheduler_pb2.RouteResponse] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            async with asyncio.timeout(timeout):
                await self._write(call, message)
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
        self._send_later(self._open(), scheduler_pb2.RouteStreamRequest(release=release))

    def _cancel(self, call_id: int) -> None:
        if self._call is not None and call_id in self._pending:
            self._send_later(self._call, scheduler_pb2.RouteStreamRequest(cancel_call_ids=[call_id]))

    def _send_later(self, call: grpc.aio.StreamStreamCall, message: scheduler_pb2.RouteStreamRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._write_quietly(call, message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _write_quietly(
        self, call: grpc.aio.StreamStreamCall, message: scheduler_pb2.RouteStreamRequest
    ) -> None:
        # A release or cancel lost with a broken stream ends with the replica's lease
        # reconciliation (heartbeats, TTL); nothing waits on it here.
        with contextlib.suppress(grpc.aio.AioRpcError, _StreamGone):
            await self._write(call, message)

    async def _write(
        self, call: grpc.aio.StreamStreamCall, message: scheduler_pb2.RouteStreamRequest
    ) -> None:
        """Writes one message; a stream already broken raises UNAVAILABLE (the caller
        tries the next replica) -- its reader fails the routes waiting on it."""
        async with self._writes:
            if call.done():
                raise _StreamGone(self._name)
            try:
                await call.write(message)
            except asyncio.InvalidStateError:  # finished between the check and the write
                raise _StreamGone(self._name) from None

    def _open(self) -> grpc.aio.StreamStreamCall:
        if self._call is not None and self._reader is not None and not self._reader.done():
            return self._call
        # No deadline: the stream outlives routes (each route has its own timeout).
        call = self._stub.RouteStream()
        self._call = call
        self._reader = asyncio.create_task(self._read(call), name=f"route-stream-{self._name}")
        return call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error = _rpc_error(grpc.StatusCode.UNAVAILABLE, f"scheduler {self._name} ended the route stream")
        try:
            async for answer in call:
                self._answer(answer)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            call.cancel()
        finally:
            if self._call is call:
                self._call = None
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
        """Half-closes the stream after what is being written (releases) and waits for its end."""
        call = self._call
        if call is not None:
            with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                async with asyncio.timeout(timeout):
                    if self._background:
                        await asyncio.wait(self._background)
                    async with self._writes:
                        if not call.done():
                            await call.done_writing()
        if self._reader is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._reader), timeout)
            self._reader.cancel()


class _StreamGone(grpc.aio.AioRpcError):
    """The route stream broke before a message could be written (UNAVAILABLE)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=f"scheduler {name}: the route stream broke",
        )
