"""One caller's `Scheduler.RouteStream`: many routes over one long-lived stream.

A gateway process keeps one RouteStream per scheduler replica instead of a unary call
per request: a stream message costs the replica about a third of a unary call's CPU
(grpc-python wakes the loop once per message instead of setting up a call). Each route
runs in its own task, because it may wait in the admission queue, and is answered when
it completes, so a queued route holds back no other. Releases and cancellations ride on
the same stream. No grpc here: the servicer feeds messages in and passes `send`, which
writes one answer.

A route that needs no waiting (most of them) is answered by the reader itself, before it
reads the next message -- no task, no queue between reader and writer: per route that
saves the replica a task wake-up and the caller part of the round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from meshserve.v1 import scheduler_pb2
from scheduler_svc import metrics
from scheduler_svc.route import Router, route_response
from services import tracing
from services.errors import Code, MeshError, classify, status_number

log = logging.getLogger(__name__)

Send = Callable[[scheduler_pb2.RouteStreamResponse], Awaitable[None]]


class RouteStreamCall:
    """The routes in flight on one RouteStream and the answers waiting to be sent."""

    def __init__(self, router: Router, lease_ttl_ms: int, draining: Callable[[], bool], send: Send) -> None:
        self._router = router
        self._lease_ttl_ms = lease_ttl_ms
        self._draining = draining
        self._send = send
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._cancelled_by_caller: set[int] = set()
        self._ready: list[scheduler_pb2.RouteStreamResponse] = []  # answered, not yet sent
        self._sending = 0
        self._input_done = False
        self.ended = asyncio.Event()

    def handle(self, message: scheduler_pb2.RouteStreamRequest) -> Awaitable[None] | None:
        """One message from the caller: releases first (they free slots the route may
        take), then cancellations, then the route. Returns the sending of the answers
        ready at once (the reader awaits it before reading on), or None."""
        if message.HasField("release"):
            self._router.release(list(message.release.lease_ids), message.release.outcomes)
        for call_id in message.cancel_call_ids:
            task = self._tasks.get(call_id)
            if task is not None:
                self._cancelled_by_caller.add(call_id)
                task.cancel()
        if message.HasField("route"):
            self._start(message.call_id, message.route)
        return self._flush() if self._ready else None

    async def _flush(self) -> None:
        """Sends the answers ready now, in order."""
        ready, self._ready = self._ready, []
        for answer in ready:
            await self._deliver(answer)

    async def _deliver(self, answer: scheduler_pb2.RouteStreamResponse) -> None:
        self._sending += 1
        try:
            await self._send(answer)
        except Exception as exc:  # the call is over (caller gone): its end closes this
            log.debug("route answer %d not sent: %s", answer.call_id, exc)
        finally:
            self._sending -= 1
            self._end_if_done()

    def _start(self, call_id: int, request: scheduler_pb2.RouteRequest) -> None:
        if call_id in self._tasks:
            self._answer_error(
                call_id, Code.INVALID_ARGUMENT, f"call_id {call_id} is already in flight", "call_id"
            )
        elif self._draining():
            self._answer_error(call_id, Code.UNAVAILABLE, "scheduler replica is draining")
        elif not self._route_now(call_id, request):
            self._tasks[call_id] = asyncio.get_running_loop().create_task(self._route(call_id, request))

    def _route_now(self, call_id: int, request: scheduler_pb2.RouteRequest) -> bool:
        """Answers a route that needs no waiting at once (most routes when workers have
        room: no task, no extra loop iteration); False when it must run as a task."""
        try:
            with _span(request):
                result = self._router.route_now(request.request, frozenset(request.exclude_worker_ids))
        except Exception as exc:  # every failure is this route's answer, never the stream's
            self._answer_failure(call_id, exc)
            return True
        if result is None:
            return False
        self._ready.append(
            scheduler_pb2.RouteStreamResponse(
                call_id=call_id, route=route_response(result, self._lease_ttl_ms)
            )
        )
        return True

    async def _route(self, call_id: int, request: scheduler_pb2.RouteRequest) -> None:
        """A route that waits (admission queue, image encoding); answered when done."""
        try:
            with _span(request):
                result = await self._router.route(
                    request.request, frozenset(request.exclude_worker_ids), request.force_encode
                )
        except asyncio.CancelledError:
            if call_id in self._cancelled_by_caller:  # else the stream is closing: no answer
                self._answer_error(call_id, Code.CANCELLED, "route cancelled by the caller")
        except Exception as exc:  # every failure is this route's answer, never the stream's
            self._answer_failure(call_id, exc)
        else:
            answer = scheduler_pb2.RouteStreamResponse(
                call_id=call_id, route=route_response(result, self._lease_ttl_ms)
            )
            self._ready.append(answer)
        finally:
            self._cancelled_by_caller.discard(call_id)
        try:
            await self._flush()
        finally:
            self._tasks.pop(call_id, None)
            self._end_if_done()

    def _answer_failure(self, call_id: int, exc: Exception) -> None:
        code, text = classify(exc)
        if code is Code.INTERNAL:
            log.exception("route %d failed", call_id, exc_info=exc)
        metrics.REJECTED.labels(code=code.value).inc()
        self._answer_error(call_id, code, text, exc.param if isinstance(exc, MeshError) else None)

    def _answer_error(self, call_id: int, code: Code, message: str, param: str | None = None) -> None:
        error = scheduler_pb2.RouteError(code=status_number(code), message=message, param=param or "")
        self._ready.append(scheduler_pb2.RouteStreamResponse(call_id=call_id, error=error))

    def input_done(self) -> None:
        """The caller half-closed (or went away): routes still waiting are cancelled."""
        self._input_done = True
        for task in self._tasks.values():
            task.cancel()
        self._end_if_done()

    def wake(self) -> None:
        """The replica started draining: an idle stream ends now, a busy one when its
        routes are answered (new ones are refused UNAVAILABLE meanwhile)."""
        self._end_if_done()

    def _end_if_done(self) -> None:
        """Ends the stream (`ended`) once nothing is in flight or being sent and the
        caller half-closed or the replica drains."""
        idle = not self._tasks and not self._sending and not self._ready
        if idle and (self._input_done or self._draining()):
            self.ended.set()

    def close(self) -> None:
        """The call ended: nothing more is answered."""
        self._input_done = True
        for task in self._tasks.values():
            task.cancel()


def _span(request: scheduler_pb2.RouteRequest) -> contextlib.AbstractContextManager[None]:
    # The caller's span comes with the request (the stream's metadata is the stream's,
    # shared by every request on it).
    return tracing.span_from(
        "scheduler.route", request.request.trace_context, request_id=request.request.request_id
    )
