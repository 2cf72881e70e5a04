"""Pieces shared by the chat and completion routes: request context, context-length
check, sampling parameters, running several generations as one, disconnect handling
and the SSE response."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pydantic_core
from fastapi import Request, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway import metrics, structured
from gateway.budgets import Reservation, TenantBudgets
from gateway.classes import DEFAULT, Classes, Resolved
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.generation import ChoiceEvent, GenerationRun, GenerationSpec, Usage
from gateway.middleware import ANONYMOUS
from gateway.protocol import PromptTokensDetails, SamplingRequest, UsageInfo
from gateway.upstream import Upstream
from meshserve.v1 import common_pb2
from services import tracing
from services.sampling_fields import OPTIONAL_SAMPLING_FIELDS

T = TypeVar("T")
R = TypeVar("R")  # a response model, or a Response
log = logging.getLogger(__name__)

# Sampling fields forwarded only when the client set them; the others are set below.
_CLIENT_SET_SAMPLING = tuple(
    name
    for name in OPTIONAL_SAMPLING_FIELDS
    if name not in ("max_tokens", "n", "logprobs", "prompt_logprobs")
)
SSE_DONE = b"data: [DONE]\n\n"


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


def new_id(prefix: str) -> str:
    """A request id such as `chatcmpl-<hex>`; also the scheduler's request_id."""
    return f"{prefix}-{uuid.uuid4().hex}"


def resolve_max_tokens(
    prompt_len: int,
    requested: int | None,
    max_model_len: int,
    default: int,
    prompt_param: str,
    max_param: str = "max_tokens",
) -> int:
    """max_tokens to ask for, or a 400 naming the model's context length."""
    if max_model_len <= 0:  # unknown limit: let the worker enforce it
        return requested if requested is not None else default
    limit = f"This model's maximum context length is {max_model_len} tokens; your request has {prompt_len} prompt tokens"
    if requested is None and prompt_len >= max_model_len:
        raise APIError(
            400,
            f"{limit}, which leaves no room for completion tokens. Please reduce the length of the {prompt_param}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is not None and prompt_len + requested > max_model_len:
        raise APIError(
            400,
            f"{limit} and asks for {requested} completion tokens ({prompt_len + requested} in total). "
            f"Please reduce the length of the {prompt_param} or {max_param}.",
            param=prompt_param if prompt_len >= max_model_len else max_param,
            code="context_length_exceeded",
        )
    if requested is not None:
        return requested
    return min(default, max_model_len - prompt_len)


def sampling_params(
    body: SamplingRequest, max_tokens: int, logprobs: int | None
) -> common_pb2.SamplingParams:
    """SamplingParams with only the fields the client set (plus max_tokens and n)."""
    params = common_pb2.SamplingParams(max_tokens=max_tokens, n=body.n, ignore_eos=body.ignore_eos)
    for name in _CLIENT_SET_SAMPLING:
        value = getattr(body, name)
        if name in body.model_fields_set and value is not None:
            setattr(params, name, value)
    if body.stop_token_ids:
        params.stop_token_ids.extend(body.stop_token_ids)
    if logprobs is not None:
        params.logprobs = logprobs
    if body.prompt_logprobs is not None:
        params.prompt_logprobs = body.prompt_logprobs
    add_token_rules(body, params)
    return params


def add_token_rules(body: SamplingRequest, params: common_pb2.SamplingParams) -> None:
    """logit_bias, allowed_token_ids, bad_words and the output constraint (checked
    here: a bad schema is a 400 naming the field before anything is routed)."""
    for token, bias in body.logit_bias_ids().items():
        params.logit_bias[token] = bias
    if body.allowed_token_ids:
        params.allowed_token_ids.extend(body.allowed_token_ids)
    if body.bad_words:
        params.bad_words.extend(body.bad_words)
    found = structured.constraint(body)
    if found is not None:
        kind, spec, param = found
        structured.check(kind, spec, param)
        params.structured_kind, params.structured_spec = kind, spec


def generation_spec(
    ctx: RequestContext,
    body: SamplingRequest,
    request_id: str,
    model: str,
    prompt_ids: list[int],
    mm_items: list[common_pb2.MultiModalItem],
    sampling: common_pb2.SamplingParams,
) -> GenerationSpec:
    """The GenerationSpec of one prompt, in its priority class (gateway/classes.py; the
    mesh runs higher priorities first: vLLM's lower-first priority is negated)."""
    if ctx.classes is None:
        klass = Resolved(DEFAULT, -body.priority, None)
    else:
        klass = ctx.classes.resolve(ctx.tenant, body.service_tier, body.priority)
    return GenerationSpec(
        request_id=request_id,
        model=model,
        prompt_ids=prompt_ids,
        mm_items=mm_items,
        sampling=sampling,
        n=body.n,
        stop=body.stop_list(),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        priority=klass.priority,
        tenant=ctx.tenant,
        service_class=klass.name,
        queue_timeout_s=klass.queue_timeout_s,
        cache_salt=body.cache_salt or "",
        constraint_param=_constraint_param(body, sampling),
    )


def _constraint_param(body: SamplingRequest, sampling: common_pb2.SamplingParams) -> str:
    """The request field of the body's output constraint ("" when it has none)."""
    found = structured.constraint(body) if sampling.structured_kind else None
    return found[2] if found is not None else ""


def usage_info(usage: Usage) -> UsageInfo:
    """OpenAI usage object."""
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


async def _no_events() -> AsyncIterator[ChoiceEvent]:
    """No event (a MultiRun that never started)."""
    return
    yield


class MultiRun:
    """Several GenerationRuns (one per prompt) seen as one: global choice index =
    prompt index × n + choice index. The first events are peeked before the HTTP
    response starts so that early upstream errors keep their HTTP status."""

    def __init__(self, runs: list[GenerationRun], n: int) -> None:
        self.runs = runs
        self.n = n
        self._budget: tuple[TenantBudgets, Reservation] | None = None
        self._held: deque[ChoiceEvent] = deque()  # what `peek` took from `_merged`
        self._iter: AsyncIterator[ChoiceEvent] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    async def reserve(self, ctx: RequestContext) -> None:
        """Takes what the runs may use from the tenant's budgets (APIError 429 when they
        cannot cover it: nothing is queued then); `close` gives back what they did not use."""
        if ctx.budgets is None or not ctx.budgets.enabled:
            return
        tokens = sum(len(r.spec.prompt_ids) + r.spec.n * r.spec.sampling.max_tokens for r in self.runs)
        reservation = await ctx.budgets.reserve(ctx.tenant, tokens, self.runs[0].spec.service_class)
        if reservation is not None:
            self._budget = (ctx.budgets, reservation)

    def start(self) -> None:
        """Starts every run. One run's events are its own generator's (no fan-in layer
        on a chat's token path)."""
        for run in self.runs:
            run.start()
        self._iter = self.runs[0].events() if len(self.runs) == 1 else self._merged()

    async def _merged(self) -> AsyncIterator[ChoiceEvent]:
        queue: asyncio.Queue[tuple[int, ChoiceEvent | BaseException | None]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._drain(i, run, queue)) for i, run in enumerate(self.runs)]
        remaining = len(self.runs)
        while remaining or self._held:
            if self._held:
                yield self._held.popleft()
                continue
            offset, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                item.index += offset * self.n
                yield item

    @staticmethod
    async def _drain(
        offset: int, run: GenerationRun, queue: asyncio.Queue[tuple[int, ChoiceEvent | BaseException | None]]
    ) -> None:
        try:
            async for event in run.events():
                queue.put_nowait((offset, event))
        except APIError as exc:
            queue.put_nowait((offset, exc))
        except Exception as exc:
            log.exception("generation %s failed", run.spec.request_id)
            queue.put_nowait((offset, APIError(500, f"internal error: {type(exc).__name__}")))
        queue.put_nowait((offset, None))

    async def begin(self) -> None:
        """Puts every run's request on its worker's stream (raising APIError when one
        cannot be routed): what a streamed response builds next is built meanwhile."""
        if len(self.runs) == 1:
            await self.runs[0].begin()
        else:
            await asyncio.gather(*(run.begin() for run in self.runs))

    async def peek(self) -> None:
        """Waits for the first event with output (raising APIError on early failures);
        what it took, `events` yields first."""
        if self._iter is None:
            return
        async for event in self._iter:
            if len(self.runs) == 1:
                self.runs[0].hold(event)
            else:
                self._held.append(event)
            if event.token_ids or event.finish_reason or event.text:
                return

    def events(self) -> AsyncIterator[ChoiceEvent]:
        """The events, those `peek` took first: for one run, that run's own generator."""
        return self._iter if self._iter is not None else _no_events()

    def usage(self) -> Usage:
        """Usage summed over the prompts."""
        parts = [run.usage() for run in self.runs]
        return Usage(
            sum(u.prompt_tokens for u in parts),
            sum(u.completion_tokens for u in parts),
            sum(u.cached_tokens for u in parts),
        )

    def prompt_logprobs(self, index: int) -> tuple[list[int], list[common_pb2.TokenLogprob]]:
        """Prompt ids and prompt logprobs (entry i scores token i + 1) of the prompt of
        choice `index`, which asked for them (they come with the run's first output);
        a 500 when the worker did not send one per prompt token after the first."""
        run = self.runs[index // self.n]
        ids, logprobs = run.spec.prompt_ids, run.prompt_logprobs or []
        if len(logprobs) != len(ids) - 1:
            raise APIError(500, f"worker: {len(logprobs)} prompt logprobs for a {len(ids)}-token prompt")
        return ids, logprobs

    def completion_tokens_so_far(self) -> int:
        """Tokens generated so far over every prompt and choice."""
        return sum(run.completion_tokens_so_far() for run in self.runs)

    def close(self) -> None:
        """Cancels every run and settles the budget reservation (synchronous, idempotent)."""
        for task in self._tasks:
            task.cancel()
        for run in self.runs:
            run.close()
        if self._closed:
            return
        self._closed = True
        used = self.usage()
        spec = self.runs[0].spec
        admitted = [run.usage() for run in self.runs if run.admitted]
        tokens = sum(u.prompt_tokens + u.completion_tokens for u in admitted)
        metrics.TENANT_TOKENS.labels(spec.tenant, spec.service_class).inc(tokens)
        if self._budget is not None:
            budgets, reservation = self._budget
            self._budget = None
            budgets.settle_soon(reservation, used.prompt_tokens + used.completion_tokens)


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


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (ClientDisconnected) if the client disconnects."""
    return await _until_disconnect(request.receive, work)


async def _until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Awaits `work` in the calling task while one watcher task waits for the client's
    `http.disconnect` and then cancels the caller (ClientDisconnected). Cheaper than
    running `work` as a task of its own next to the watcher: one task, no asyncio.wait."""
    caller = asyncio.current_task()
    if caller is None:
        raise RuntimeError("_until_disconnect must run in a task")
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while (await receive())["type"] != "http.disconnect":
            pass
        disconnected = True
        caller.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not disconnected:
            raise
        caller.uncancel()
        raise ClientDisconnected from None
    finally:
        watcher.cancel()


class TextChunkTemplate:
    """The SSE event of a plain text chunk (one choice, only its text differs), rendered
    without building the chunk model per token: the template is the model's own JSON
    with a placeholder text, and the text goes in through pydantic's own string encoder,
    so the bytes equal `sse_event(chunk)` exactly, at a fraction of the model's cost."""

    _SLOT = "\x00meshserve-text-slot\x00"

    def __init__(self, make_chunk: Callable[[str], BaseModel]) -> None:
        """`make_chunk(text)` builds the chunk whose only variable part is `text`."""
        event = sse_event(make_chunk(self._SLOT))
        self._head, slot, self._tail = event.partition(pydantic_core.to_json(self._SLOT))
        if not slot or self._SLOT.encode() in self._tail:
            raise ValueError("the chunk must hold the text exactly once")

    def render(self, text: str) -> bytes:
        """The event for `text`."""
        return self._head + escape_line_breaks(pydantic_core.to_json(text)) + self._tail


# Characters that JSON leaves unescaped but that readers splitting text with Python's
# str.splitlines (httpx's aiter_lines, for one) take for line ends: an event holding one
# would reach such a client cut in two. JSON's own escapes mean the same text.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def escape_line_breaks(data: bytes) -> bytes:
    """`data` (UTF-8 JSON) with U+0085, U+2028 and U+2029 written as JSON escapes, so an
    SSE event is one line for every line splitter, not only the CR/LF of the SSE spec."""
    if b"\xc2\x85" not in data and b"\xe2\x80" not in data:
        return data
    for raw, escaped in _LINE_BREAKS:
        data = data.replace(raw, escaped)
    return data


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    """One `data: <json>` event; models are dumped without their unset optional fields."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_unset=True)
    else:
        text = json.dumps(payload, ensure_ascii=False)
    return b"data: " + escape_line_breaks(text.encode()) + b"\n\n"


# Every SSE response: no cache, and no buffering in a proxy (nginx) on the way.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """`text/event-stream` response that always runs `on_close` when it ends, however
    it ends (completed, client disconnect, cancellation).

    With `ready` (the generation's first output, `MultiRun.peek`), the response is
    handed to the server before the first token and waits for it: an APIError before
    it is answered with its own HTTP status (not as an event of a 200 stream), and once
    the first token arrives only the writes are left on its way to the client -- the
    handler's return, this response and its stream (templates, role chunks) were built
    during the prefill (docs/design-decisions.md, "Generation endpoints served past
    FastAPI's router")."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], None],
        span: tracing.PhaseSpan,
        ready: Awaitable[None] | None = None,
    ) -> None:
        """`span`: the request's span, current while the response runs (a route made for
        a mid-stream migration is its child) and ended after `on_close`."""
        super().__init__(content, headers=SSE_HEADERS)
        self._on_close = on_close
        self._span = span
        self._ready = ready

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Waits for `ready`, then streams until the body ends or the client disconnects,
        then closes the upstream calls. (Starlette's own __call__ runs the stream and a
        disconnect listener in an anyio task group per response under uvicorn's ASGI
        2.3; one watcher task does the same here for less.)"""
        try:
            with self._span.current():
                await _until_disconnect(receive, self._respond(scope, receive, send))
        except (ClientDisconnected, OSError):
            pass  # the client went away: nothing more to send
        finally:
            if self._ready is not None and inspect.iscoroutine(self._ready):
                self._ready.close()  # never awaited (the client left at once): no warning
            self._on_close()
            self._span.end()

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._ready is not None:
            ready, self._ready = self._ready, None
            try:
                await ready
            except APIError as exc:
                await exc.response(scope["path"])(scope, receive, send)
                return
        await self.stream_response(send)
