"""One generation: the scheduler's Generate stream fanned out into one tokenizer
DetokenizeStream per choice, merged back into per-choice text events.

Data flow of a `GenerationRun`:

* a pump task reads `Scheduler.Generate` and forwards each choice's new token ids
  to that choice's `DetokenizeStream` (`start` first, then `tokens`, and `finish=true`
  with the last tokens once the sequence finished upstream; then half-close);
* one reader task per choice puts the detokenizer's responses on a queue;
* `events()` turns them into `ChoiceEvent`s. A response with `stopped` ends its choice
  with finish_reason "stop"; the end of a detokenize stream after `finish` ends it with
  the upstream reason. Once every choice has ended early, `Abort(request_id)` frees
  the worker's KV blocks at once.

Token/logprob alignment uses the detokenizer's `num_tokens` (tokens consumed so far).
`close()` is synchronous so it can run inside a cancelled scope: it cancels the
Generate call (the scheduler then aborts the request on the worker), every
detokenize stream and task, and sends a best-effort Abort in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway.errors import APIError, from_rpc_error
from gateway.upstream import SCHEDULER, TOKENIZER, Upstream
from meshserve.v1 import common_pb2, tokenizer_pb2

log = logging.getLogger(__name__)

# Prompt ids sent with DetokenizeStart so the first generated tokens decode in context.
PROMPT_TAIL = 8
# After Abort, how long to wait for the scheduler's final message (usage, cached tokens).
ABORT_DRAIN_S = 1.0

_FINISH_NAMES: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
}

_BACKGROUND: set[asyncio.Task[None]] = set()


@dataclass(frozen=True)
class GenerationSpec:
    """Everything needed to run one prompt through the mesh."""

    request_id: str
    model: str
    prompt_ids: list[int]
    mm_items: list[common_pb2.MultiModalItem]
    sampling: common_pb2.SamplingParams
    n: int
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    priority: int
    tenant: str
    cache_salt: str = ""

    def generate_request(self) -> common_pb2.GenerateRequest:
        """The scheduler request."""
        return common_pb2.GenerateRequest(
            request_id=self.request_id,
            model=self.model,
            prompt_token_ids=self.prompt_ids,
            sampling=self.sampling,
            priority=self.priority,
            tenant=self.tenant,
            mm_items=self.mm_items,
            cache_salt=self.cache_salt,
        )

    def detokenize_start(self) -> tokenizer_pb2.DetokenizeStreamRequest:
        """The first message of each choice's DetokenizeStream."""
        return tokenizer_pb2.DetokenizeStreamRequest(
            start=tokenizer_pb2.DetokenizeStart(
                model=self.model,
                prompt_token_ids=self.prompt_ids[-PROMPT_TAIL:],
                skip_special_tokens=self.skip_special_tokens,
                stop=self.stop,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        )


@dataclass
class ChoiceEvent:
    """New output of one choice: text, the tokens it came from, and maybe the end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Usage:
    """Token accounting of a finished run (prompt counted once, not per choice)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    consumed: int = 0
    upstream_finish: int | None = None
    stop_token_id: int | None = None
    ended: bool = False
    completion_tokens: int = 0


@dataclass
class _DetokItem:
    index: int
    response: tokenizer_pb2.DetokenizeStreamResponse | None  # None = end of stream
    error: APIError | None = None


@dataclass
class _GenItem:
    done: bool = False
    error: APIError | None = None


class _Decoder:
    """One choice's DetokenizeStream; requests are queued, responses go to `out`."""

    def __init__(
        self, upstream: Upstream, index: int, spec: GenerationSpec, out: asyncio.Queue[object]
    ) -> None:
        self.index = index
        self._requests: asyncio.Queue[tokenizer_pb2.DetokenizeStreamRequest | None] = asyncio.Queue()
        self._requests.put_nowait(spec.detokenize_start())
        self._out = out
        self._closed = False
        self._half_closed = False
        self._call = upstream.tokenizer.DetokenizeStream(self._request_iter(), timeout=upstream.timeout)
        self._task = asyncio.create_task(self._read())

    async def _request_iter(self) -> AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest]:
        while (message := await self._requests.get()) is not None:
            end = False
            # Under load tokens arrive faster than the stream sends: merge what queued
            # up, one message per write instead of one per worker step.
            while not self._requests.empty() and not message.finish and not message.HasField("start"):
                more = self._requests.get_nowait()
                if more is None:
                    end = True
                    break
                message.tokens.ids.extend(more.tokens.ids)
                message.finish = more.finish
            yield message
            if end:
                return

    def feed(self, token_ids: list[int], finish: bool) -> None:
        """Queues new tokens; `finish` flushes held-back text and half-closes."""
        if self._half_closed:
            return
        message = tokenizer_pb2.DetokenizeStreamRequest(finish=finish)
        if token_ids:
            message.tokens.ids.extend(token_ids)
        self._requests.put_nowait(message)
        if finish:
            self._half_closed = True
            self._requests.put_nowait(None)

    async def _read(self) -> None:
        try:
            async for response in self._call:
                self._out.put_nowait(_DetokItem(self.index, response))
        except grpc.aio.AioRpcError as exc:
            if not self._closed:
                self._out.put_nowait(_DetokItem(self.index, None, from_rpc_error(exc, TOKENIZER)))
            return
        self._out.put_nowait(_DetokItem(self.index, None))

    def close(self) -> None:
        """Cancels the stream (idempotent, synchronous)."""
        self._closed = True
        self._half_closed = True
        self._call.cancel()
        self._task.cancel()


class GenerationRun:
    """Runs one GenerateRequest and yields per-choice `ChoiceEvent`s (see module doc)."""

    def __init__(self, upstream: Upstream, spec: GenerationSpec) -> None:
        self.upstream = upstream
        self.spec = spec
        self.worker_id = ""
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._choices = [_Choice(i) for i in range(spec.n)]
        self._decoders: list[_Decoder] = []
        self._gen_call: grpc.aio.UnaryStreamCall | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self._gen_done = False
        self._stream_over = False
        self._aborting = False
        self._closed = False
        self._cached_tokens = 0

    def start(self) -> None:
        """Opens the Generate call and the per-choice detokenize streams."""
        self._decoders = [_Decoder(self.upstream, i, self.spec, self._queue) for i in range(self.spec.n)]
        self._gen_call = self.upstream.scheduler.Generate(
            self.spec.generate_request(), timeout=self.upstream.timeout
        )
        self._pump_task = asyncio.create_task(self._pump(self._gen_call))

    async def _pump(self, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            async for response in call:
                self._on_generate(response)
        except grpc.aio.AioRpcError as exc:
            if not self._aborting and not self._closed:
                self._queue.put_nowait(_GenItem(error=from_rpc_error(exc, SCHEDULER)))
        finally:
            self._stream_over = True
        self._queue.put_nowait(_GenItem(done=True))

    def _on_generate(self, response: common_pb2.GenerateResponse) -> None:
        if response.worker_id:
            self.worker_id = response.worker_id
        if response.HasField("usage"):
            self._cached_tokens = response.usage.cached_tokens
        for delta in response.deltas:
            if not 0 <= delta.index < len(self._choices):
                log.warning("%s: delta for unknown choice %d", self.spec.request_id, delta.index)
                continue
            self._on_delta(self._choices[delta.index], delta)

    def _on_delta(self, choice: _Choice, delta: common_pb2.SequenceDelta) -> None:
        if choice.ended or choice.upstream_finish is not None:
            return
        reason = delta.finish_reason
        if reason in (common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_ERROR):
            if not self._aborting:
                self._queue.put_nowait(_GenItem(error=_upstream_failure(reason)))
            return
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs)
        finished = reason != common_pb2.FINISH_REASON_UNSPECIFIED
        if finished:
            choice.upstream_finish = reason
            if delta.HasField("stop_token_id"):
                choice.stop_token_id = delta.stop_token_id
        self._decoders[choice.index].feed(list(delta.token_ids), finished)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Per-choice events until every choice has ended; raises APIError on failure."""
        while not all(c.ended for c in self._choices):
            item = await self._queue.get()
            if isinstance(item, _GenItem):
                self._on_gen_item(item)
            elif isinstance(item, _DetokItem):
                event = self._on_detok(item)
                if event is not None:
                    yield event
        await self._finish_upstream()

    def _on_gen_item(self, item: _GenItem) -> None:
        if item.error is not None:
            raise item.error
        self._gen_done = True
        unfinished = [c.index for c in self._choices if c.upstream_finish is None and not c.ended]
        if unfinished:
            raise APIError(
                502, f"scheduler: stream ended before choices {unfinished} finished", code="internal"
            )

    def _on_detok(self, item: _DetokItem) -> ChoiceEvent | None:
        if item.error is not None:
            raise item.error
        choice = self._choices[item.index]
        if choice.ended:
            return None
        response = item.response
        if response is None:
            return self._end_of_stream(choice)
        new_ids, new_logprobs = self._consume(choice, response.num_tokens)
        event = ChoiceEvent(choice.index, response.text, new_ids, new_logprobs)
        if response.stopped:
            choice.ended = True
            choice.completion_tokens = choice.consumed
            event.finish_reason, event.stop_reason = "stop", response.matched_stop
            self._decoders[choice.index].close()
        return event

    def _consume(self, choice: _Choice, num_tokens: int) -> tuple[list[int], list[common_pb2.TokenLogprob]]:
        """Tokens (and their logprobs) newly consumed by the detokenizer."""
        upto = min(max(num_tokens, choice.consumed), len(choice.token_ids))
        start, choice.consumed = choice.consumed, upto
        return choice.token_ids[start:upto], choice.logprobs[start:upto]

    def _end_of_stream(self, choice: _Choice) -> ChoiceEvent:
        if choice.upstream_finish is None:
            raise APIError(502, "tokenizer: detokenize stream ended early", code="internal")
        new_ids, new_logprobs = self._consume(choice, len(choice.token_ids))
        choice.ended = True
        choice.completion_tokens = len(choice.token_ids)
        stop_reason = (
            choice.stop_token_id if choice.upstream_finish == common_pb2.FINISH_REASON_STOP else None
        )
        return ChoiceEvent(
            choice.index, "", new_ids, new_logprobs, _FINISH_NAMES[choice.upstream_finish], stop_reason
        )

    async def _finish_upstream(self) -> None:
        """Every choice ended: abort generation still running, wait briefly for usage."""
        if self._gen_done:
            return
        if any(c.upstream_finish is None for c in self._choices):
            self._aborting = True
            await self._abort()
            timeout = ABORT_DRAIN_S
        else:
            timeout = self.upstream.timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wait_gen_done(), timeout)

    async def _wait_gen_done(self) -> None:
        while not self._gen_done:
            item = await self._queue.get()
            if isinstance(item, _GenItem) and (item.done or item.error is not None):
                self._gen_done = True

    async def _abort(self) -> None:
        try:
            await self.upstream.scheduler.Abort(
                common_pb2.AbortRequest(request_id=self.spec.request_id), timeout=5.0
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("abort of %s failed: %s", self.spec.request_id, exc.details())

    def usage(self) -> Usage:
        """Usage of the run; completion tokens are those each choice consumed."""
        completion = sum(c.completion_tokens for c in self._choices)
        return Usage(len(self.spec.prompt_ids), completion, self._cached_tokens)

    def completion_tokens_so_far(self) -> int:
        """Tokens consumed so far over all choices (continuous usage stats)."""
        return sum(c.completion_tokens if c.ended else c.consumed for c in self._choices)

    def close(self) -> None:
        """Cancels everything still running (idempotent, synchronous; see module doc)."""
        if self._closed:
            return
        self._closed = True
        for decoder in self._decoders:
            decoder.close()
        if self._gen_call is not None and not self._stream_over:
            self._gen_call.cancel()
            if not self._aborting:
                _spawn(self._abort())
        if self._pump_task is not None:
            self._pump_task.cancel()


def _upstream_failure(reason: int) -> APIError:
    if reason == common_pb2.FINISH_REASON_ABORT:
        return APIError(503, "scheduler: the request was aborted by the server", code="aborted")
    return APIError(500, "scheduler: generation failed inside the serving stack", code="internal")


def _spawn(coro: Coroutine[Any, Any, None]) -> None:
    """Runs a fire-and-forget coroutine, keeping a reference until it finishes."""
    try:
        task = asyncio.get_running_loop().create_task(coro)
    except RuntimeError:
        coro.close()
        return
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
