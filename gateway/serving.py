"""The route-serving glue of the generation endpoints: the request's context, and
answering a started generation (collected, or streamed as SSE) under its span."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import Request, Response

from gateway.budgets import TenantBudgets
from gateway.classes import Classes
from gateway.config import GatewayConfig
from gateway.disconnect import ClientDisconnected, cancel_on_disconnect
from gateway.middleware import ANONYMOUS
from gateway.multi_run import MultiRun
from gateway.sse import SSEResponse
from gateway.upstream import Upstream
from services import tracing

R = TypeVar("R")  # a response model, or a Response


@dataclass(frozen=True)
class RequestContext:
    """Per-request facts the handlers need."""

    config: GatewayConfig
    upstream: Upstream
    tenant: str
    start_time: float
    created: int
    budgets: TenantBudgets | None = None
    classes: Classes | None = None


def request_context(request: Request) -> RequestContext:
    """Config, upstream clients, tenant and arrival time of `request`."""
    state = request.state
    return RequestContext(
        config=request.app.state.config,
        upstream=request.app.state.upstream,
        tenant=getattr(state, "tenant", ANONYMOUS),
        budgets=getattr(request.app.state, "budgets", None),
        classes=getattr(request.app.state, "classes", None),
        start_time=getattr(state, "start_time", time.perf_counter()),
        created=int(time.time()),
    )


def background_context(app: Any, tenant: str) -> RequestContext:
    """The context of a background response a replica adopted: ``tenant``'s, with no
    budget to charge (its first replica charged it)."""
    return RequestContext(
        config=app.state.config,
        upstream=app.state.upstream,
        tenant=tenant,
        classes=getattr(app.state, "classes", None),
        start_time=time.perf_counter(),
        created=int(time.time()),
    )


@dataclass(frozen=True)
class Generation(Generic[R]):
    """A generation endpoint's request, started: its runs, and how to answer it."""

    multi: MultiRun
    stream: Callable[[], AsyncIterator[bytes]]  # the SSE events of a streamed answer
    collect: Callable[[], Awaitable[R]]  # the whole answer of a non-streamed one


async def respond(
    request: Request, span: tracing.PhaseSpan, start: Callable[[], Awaitable[Generation[R]]], stream: bool
) -> R | Response:
    """Answers a generation request under `span`, which covers it to its last byte: a
    streamed answer (`streamed`) ends it when the response ends, however it ends; any
    other answer (collected, error, client gone) when this returns or raises."""
    generation: Generation[R] | None = None
    handed_off = False
    try:
        with span.current():
            generation = await start()
            try:
                if stream:
                    response = await streamed(request, generation, span)
                    handed_off = True
                    return response
                return await cancel_on_disconnect(request, generation.collect())
            except ClientDisconnected:  # inside the span's block: not recorded as its error
                return Response(status_code=499)
    finally:
        if not handed_off:
            if generation is not None:
                generation.multi.close()
            span.end()


async def streamed(request: Request, generation: Generation[R], span: tracing.PhaseSpan) -> SSEResponse:
    """The SSE response of a streamed generation: the requests go on their workers first
    (a disconnect meanwhile raises ClientDisconnected), then the stream is built during
    the prefill and the response waits for the first output (`SSEResponse` `ready`).
    The response runs under `span` and ends it."""
    multi = generation.multi
    await cancel_on_disconnect(request, multi.begin())
    return SSEResponse(generation.stream(), on_close=multi.close, span=span, ready=multi.peek())
