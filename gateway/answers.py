"""What the chat and text completion answers share (`gateway.chat`, `gateway.completions`):
a request's way from its arrival to its answer (`serve`), the started request an answer
is built for and how it is answered (`StartedRequest.answered_by`), a collector
gathering every choice's output for the JSON answer, and a streamer turning the events
into SSE chunks. Each route adds how it starts its runs and its own choices: how a
choice is assembled and what one event's chunks are."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from fastapi import Request, Response

from gateway import metrics
from gateway.errors import APIError
from gateway.generation import ChoiceEvent, Usage
from gateway.logprobs import resolve_strings
from gateway.multi_run import MultiRun, usage_info
from gateway.protocol import ChatCompletionChunk, CompletionChunk, SamplingRequest
from gateway.request_specs import new_id
from gateway.serving import Generation, RequestContext, request_context, respond
from gateway.sse import SSE_DONE, TextChunkTemplate, sse_event
from meshserve.v1 import common_pb2
from services import tracing

log = logging.getLogger(__name__)
B = TypeVar("B", bound=SamplingRequest)
ChunkT = TypeVar("ChunkT", ChatCompletionChunk, CompletionChunk)
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
P = ParamSpec("P")


async def serve(
    request: Request,
    body: SamplingRequest,
    id_prefix: str,
    span_name: str,
    start: Callable[[RequestContext, str, str], Awaitable[Generation[R]]],
) -> R | Response:
    """A generation route's request from its arrival to its answer: the body checked
    against the gateway's limits, its model resolved and its id made (`id_prefix-<hex>`),
    then `start(ctx, model, request_id)` answered (`respond`) under the span `span_name`."""
    ctx = request_context(request)
    body.check(ctx.config.max_n)
    model = await ctx.upstream.resolve_model(body.model)
    request_id = new_id(id_prefix)
    span = tracing.PhaseSpan(span_name, model=model, request_id=request_id)
    return await respond(request, span, lambda: start(ctx, model, request_id), body.stream)


@dataclass(frozen=True)
class StartedRequest:
    """A generation request whose runs have started: what its answer is built for."""

    ctx: RequestContext
    request_id: str
    model: str
    multi: MultiRun

    def answered_by(
        self,
        streamer: Callable[Concatenate[StartedRequest, P], ChoiceStreamer[Any, Any]],
        collector: Callable[Concatenate[StartedRequest, P], Collects[R]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Generation[R]:
        """The request's answer: streamed by `streamer(self, *args, **kwargs)`, collected by
        `collector(self, *args, **kwargs)`. Only the one of the way the answer takes (streamed
        or collected) is built: building one starts its route's metrics timer."""
        return Generation(
            self.multi,
            stream=lambda: streamer(self, *args, **kwargs).stream(),
            collect=lambda: collector(self, *args, **kwargs).collect(),
        )


class Collects(Protocol[R_co]):
    """What collects a route's non-streamed answer (its ChoiceCollector)."""

    def collect(self) -> Awaitable[R_co]:
        """The whole answer."""
        ...


@dataclass
class ChoiceOutput:
    """One choice's output, gathered for a non-streamed answer."""

    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Answer(Generic[B]):
    """The request an answer is built for, its body and the metrics timer of its route."""

    def __init__(self, started: StartedRequest, body: B, route: str) -> None:
        """`route`: the metrics label (the Responses and Messages APIs answer on the chat path)."""
        self.ctx, self.request_id = started.ctx, started.request_id
        self.model, self.multi = started.model, started.multi
        self.body = body
        self.timer = metrics.GenerationTimer(route, self.ctx.start_time)

    def head(self) -> dict[str, Any]:
        """The id, created time and model every response and chunk of the request carries."""
        return {"id": self.request_id, "created": self.ctx.created, "model": self.model}

    def usage(self) -> Usage:
        """The request's usage (a route may count its own way)."""
        return self.multi.usage()


class ChoiceCollector(Answer[B]):
    """The non-streamed answer: every event consumed, each choice's output gathered."""

    async def gather(
        self, keep_output: bool, logprobs: bool, top_k: int
    ) -> tuple[list[ChoiceOutput], Usage, dict[int, str]]:
        """Every choice's output (with `keep_output` false only how it ended), the usage,
        and with `logprobs` the strings of the tokens their logprobs name (`top_k`
        alternatives each)."""
        choices = [ChoiceOutput() for _ in range(len(self.multi.runs) * self.multi.n)]
        async for event in self.multi.events():
            self.timer.on_output(len(event.token_ids))
            acc = choices[event.index]
            if keep_output:
                acc.text.append(event.text)
                acc.logprobs.extend(event.logprobs)
            if event.finish_reason is not None:
                acc.finish_reason, acc.stop_reason = event.finish_reason, event.stop_reason
        usage = self.usage()
        self.timer.finish(usage.prompt_tokens, usage.completion_tokens)
        raw = [lp for acc in choices for lp in acc.logprobs] if logprobs else []
        strings = await resolve_strings(self.ctx.upstream, self.model, raw, top_k)
        return choices, usage, strings


class ChoiceStreamer(Answer[B], ABC, Generic[B, ChunkT]):
    """The SSE answer: the route's opening events, each event's chunks, the usage chunk
    when asked, then [DONE]; an error on the way becomes an error event before [DONE].
    Text-only events of the choices with a template skip building a chunk (the hot path)."""

    chunk_type: type[ChunkT]

    def __init__(self, started: StartedRequest, body: B, route: str) -> None:
        super().__init__(started, body, route)
        options = body.stream_options
        self.include_usage = options is not None and options.include_usage
        self.continuous_usage = options is not None and options.continuous_usage_stats
        # The route fills it while the stream is built (before the first token: during the prefill).
        self._templates: dict[int, TextChunkTemplate] = {}

    def opening(self) -> Iterable[bytes]:
        """The events sent before the first output (none here)."""
        return ()

    @abstractmethod
    async def on_event(self, event: ChoiceEvent) -> list[ChunkT]:
        """The chunks of one event that is not sent through a template."""

    def chunk(self, choices: list[Any]) -> ChunkT:
        """A chunk of `choices` with the request's id/model (and running usage when asked)."""
        chunk = self.chunk_type(**self.head(), choices=choices)
        if self.continuous_usage:
            chunk.usage = usage_info(self.running_usage())
        return chunk

    def running_usage(self) -> Usage:
        """The usage so far, for `continuous_usage_stats`."""
        usage = self.usage()
        usage.completion_tokens = self.multi.completion_tokens_so_far()
        return usage

    def _plain(self, event: ChoiceEvent) -> bytes | None:
        """The event of a text-only chunk through its choice's template, or None when the
        event needs the full chunk (no template, or the choice's finish)."""
        template = self._templates.get(event.index)
        if event.finish_reason is not None or template is None:
            return None
        self.timer.on_output(len(event.token_ids))
        if not event.text:
            return b""
        return template.render(event.text)

    async def stream(self) -> AsyncIterator[bytes]:
        """The SSE body: opening events, the events' chunks, optional usage chunk, [DONE]."""
        try:
            for data in self.opening():
                yield data
            async for event in self.multi.events():
                plain = self._plain(event)
                if plain is not None:
                    if plain:
                        yield plain
                    continue
                for chunk in await self.on_event(event):
                    yield sse_event(chunk)
            usage = self.usage()
            self.timer.finish(usage.prompt_tokens, usage.completion_tokens)
            if self.include_usage:
                yield sse_event(self.chunk_type(**self.head(), choices=[], usage=usage_info(usage)))
        except APIError as exc:
            yield sse_event(exc.body())
        except Exception as exc:
            log.exception("%s: stream failed", self.request_id)
            yield sse_event(APIError(500, f"internal error: {type(exc).__name__}").body())
        yield SSE_DONE
