"""`POST /v1/completions`: each prompt rendered in-process (the gateway's copy of the
tokenizer, `services.completion_prompt`) → context check → route + the worker stream,
detokenized in-process (`generation.py`) → OpenAI text completion (JSON) or chunks (SSE).

Several prompts (a list of strings or of token-id lists) run concurrently as one
request; choice `index` is prompt index × n + choice index, as in OpenAI/vLLM.
`echo` prefixes each choice with its prompt text; with `logprobs`, its logprobs start with
the prompt's (computed by the engine in the prefill: `sampling.prompt_logprobs`), the first
token's None; `max_tokens: 0` with echo returns the prompt alone (loglikelihood scoring).
`prompt_logprobs` (vLLM) adds each prompt token's top-K on the choice.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import Request, Response

from gateway.answers import ChoiceCollector, ChoiceOutput, ChoiceStreamer, StartedRequest, serve
from gateway.errors import from_mesh_error
from gateway.generation import ChoiceEvent, GenerationRun, Usage
from gateway.logprobs import (
    completion_logprobs,
    echo_part,
    end_offset,
    joined,
    resolve_strings,
    vllm_prompt_logprobs,
)
from gateway.multi_run import MultiRun, usage_info
from gateway.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from gateway.request_specs import generation_spec, resolve_max_tokens, sampling_params
from gateway.serving import Generation, RequestContext
from gateway.sse import TextChunkTemplate, sse_event
from gateway.upstream import TOKENIZER
from meshserve.v1 import common_pb2, tokenizer_pb2
from services.completion_prompt import ImageToken, completion_token_ids
from services.errors import MeshError

ROUTE = "/v1/completions"


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    text: str
    mm_items: list[common_pb2.MultiModalItem]


# Text longer than this is tokenized off the event loop (a long prompt takes milliseconds).
LONG_PROMPT_CHARS = 4096


async def _render(
    ctx: RequestContext,
    body: CompletionRequest,
    model: str,
    info: tokenizer_pb2.TokenizerInfo,
    prompt: str | list[int],
) -> _Prompt:
    """One prompt's token ids, rendered in-process with the gateway's copy of the model's
    tokenizer (`services.completion_prompt`, as the tokenizer service renders them), plus
    its text when echo needs it. Completion prompts are text only: no round trip."""
    try:
        tokenizer = await ctx.upstream.tokenizers.get(model)
        image = ImageToken(info.image_token_id, info.image_token) if info.HasField("image_token_id") else None
        text = prompt if isinstance(prompt, str) else None
        render = functools.partial(
            completion_token_ids,
            tokenizer.tokenizer,
            info.vocab_size,
            image,
            text,
            None if isinstance(prompt, str) else prompt,
            body.add_special_tokens,
        )
        ids = await asyncio.to_thread(render) if text and len(text) > LONG_PROMPT_CHARS else render()
    except MeshError as exc:
        raise from_mesh_error(exc, TOKENIZER) from exc
    if not body.echo:
        return _Prompt(ids, "", [])
    echo = text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
    return _Prompt(ids, echo, [])


async def start_completion(
    ctx: RequestContext, body: CompletionRequest, model: str, request_id: str
) -> tuple[MultiRun, list[_Prompt]]:
    """Renders every prompt, checks context lengths and starts generation."""
    upstream = ctx.upstream
    info = await upstream.tokenizer_info(model)
    prompts = [await _render(ctx, body, model, info, p) for p in body.prompts()]
    runs = []
    for i, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(
            len(prompt.ids), body.max_tokens, info.max_model_len, ctx.config.default_max_tokens, "prompt"
        )
        # echo with max_tokens 0: one token is generated (from the prefill's logits) and dropped.
        sampling = sampling_params(body, max(max_tokens, 1), body.logprobs)
        prompt_k = body.engine_prompt_logprobs()
        if prompt_k is not None:
            sampling.prompt_logprobs = prompt_k
        run_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        spec = generation_spec(ctx, body, run_id, model, prompt.ids, prompt.mm_items, sampling)
        runs.append(GenerationRun(upstream, spec))
    multi = MultiRun(runs, body.n)
    await multi.reserve(ctx)
    multi.start()
    return multi, prompts


async def create_completion(body: CompletionRequest, request: Request) -> CompletionResponse | Response:
    """Route handler (see module docstring)."""

    async def start(ctx: RequestContext, model: str, request_id: str) -> Generation[CompletionResponse]:
        multi, prompts = await start_completion(ctx, body, model, request_id)
        echoes = [p.text if body.echo else "" for p in prompts for _ in range(body.n)]
        started = StartedRequest(ctx, request_id, model, multi)
        return started.answered_by(CompletionStreamer, CompletionCollector, body, echoes)

    return await serve(request, body, "cmpl", "gateway.completions", start)


def _usage(body: CompletionRequest, multi: MultiRun) -> Usage:
    """The request's usage; echo with max_tokens 0 returns no completion token."""
    usage = multi.usage()
    if body.echo_only():
        usage.completion_tokens = 0
    return usage


class CompletionCollector(ChoiceCollector[CompletionRequest]):
    """Builds the non-streamed response."""

    def __init__(self, started: StartedRequest, body: CompletionRequest, echoes: list[str]) -> None:
        """`echoes`: each choice's echoed prompt text ("" without echo)."""
        super().__init__(started, body, ROUTE)
        self.echoes = echoes

    def usage(self) -> Usage:
        """The request's usage, echo-only requests' dropped token left out."""
        return _usage(self.body, self.multi)

    async def collect(self) -> CompletionResponse:
        """Consumes every event and assembles the response."""
        body = self.body
        # echo with max_tokens 0: its one generated token is dropped
        gathered, usage, strings = await self.gather(
            not body.echo_only(), body.logprobs is not None, body.logprobs or 0
        )
        choices = [await self._choice(index, acc, strings) for index, acc in enumerate(gathered)]
        return CompletionResponse(**self.head(), choices=choices, usage=usage_info(usage))

    async def _choice(self, index: int, acc: ChoiceOutput, strings: dict[int, str]) -> CompletionChoice:
        body = self.body
        logprobs = None
        if body.logprobs is not None:
            if body.echo:
                head = await echo_part(
                    self.ctx.upstream, self.model, *self.multi.prompt_logprobs(index), body.logprobs
                )
                logprobs = joined(
                    head, completion_logprobs(acc.logprobs, strings, body.logprobs, end_offset(head))
                )
            else:
                logprobs = completion_logprobs(acc.logprobs, strings, body.logprobs, 0)
        choice = CompletionChoice(
            index=index,
            text=self.echoes[index] + "".join(acc.text),
            logprobs=logprobs,
            finish_reason="length" if body.echo_only() else acc.finish_reason,  # type: ignore[arg-type]
            stop_reason=None if body.echo_only() else acc.stop_reason,
        )
        if body.prompt_logprobs is not None:
            _, prompt = self.multi.prompt_logprobs(index)
            choice.prompt_logprobs = await vllm_prompt_logprobs(
                self.ctx.upstream, self.model, prompt, body.prompt_logprobs
            )
        return choice


class CompletionStreamer(ChoiceStreamer[CompletionRequest, CompletionChunk]):
    """Turns events into completion chunks (SSE): plain echoes first."""

    chunk_type = CompletionChunk

    def __init__(self, started: StartedRequest, body: CompletionRequest, echoes: list[str]) -> None:
        """`echoes`: each choice's echoed prompt text ("" without echo)."""
        super().__init__(started, body, ROUTE)
        self.echoes = echoes
        self.offsets = [0] * len(echoes)
        # echo with logprobs: the prompt text goes out with the choice's first event, once
        # its logprobs (they come with the first output) are there; plain echo goes first.
        self.echo_with_first = set(range(len(echoes))) if body.echo and body.logprobs is not None else set()
        # Built now, before the first token (the stream is created during the prefill).
        self._templates = (
            {}
            if self.continuous_usage or body.logprobs is not None or body.echo_only()
            else {index: self._template(index) for index in range(len(echoes))}
        )

    def _template(self, index: int) -> TextChunkTemplate:
        return TextChunkTemplate(
            lambda text: self.chunk(
                [CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None)]
            )
        )

    def usage(self) -> Usage:
        """The request's usage, echo-only requests' dropped token left out."""
        return _usage(self.body, self.multi)

    def running_usage(self) -> Usage:
        """The usage so far; an echo-only request's stays without completion tokens."""
        return self.usage() if self.body.echo_only() else super().running_usage()

    def opening(self) -> Iterator[bytes]:
        """The echo chunks that need not wait for the prompt's logprobs."""
        for index, echo in enumerate(self.echoes):
            if echo and index not in self.echo_with_first:
                self.offsets[index] = len(echo)
                choice = CompletionChoice(index=index, text=echo, logprobs=None, finish_reason=None)
                yield sse_event(self.chunk([choice]))

    def _plain(self, event: ChoiceEvent) -> bytes | None:
        """The templated text-only event (see `ChoiceStreamer`), its text counted in the
        choice's offset."""
        plain = super()._plain(event)
        if plain is not None:
            self.offsets[event.index] += len(event.text)
        return plain

    async def on_event(self, event: ChoiceEvent) -> list[CompletionChunk]:
        """The chunk of one event (none when it carries nothing to send)."""
        choice = await self._event_choice(event)
        return [self.chunk([choice])] if choice is not None else []

    async def _event_choice(self, event: ChoiceEvent) -> CompletionChoice | None:
        """The choice delta of one event (None when it carries nothing to send); the
        choice's first one starts with its echo when that waited for the prompt's logprobs."""
        self.timer.on_output(len(event.token_ids))
        index, echo_only = event.index, self.body.echo_only()
        text, generated = ("", []) if echo_only else (event.text, event.logprobs)
        head: CompletionLogprobs | None = None
        if index in self.echo_with_first:
            self.echo_with_first.discard(index)
            head = await echo_part(
                self.ctx.upstream, self.model, *self.multi.prompt_logprobs(index), self.body.logprobs or 0
            )
            text = self.echoes[index] + text
            self.offsets[index] = end_offset(head)
        logprobs: CompletionLogprobs | None = head
        if self.body.logprobs is not None and generated:
            top_k = self.body.logprobs
            strings = await resolve_strings(self.ctx.upstream, self.model, generated, top_k)
            part = completion_logprobs(generated, strings, top_k, self.offsets[index])
            logprobs = joined(head, part) if head is not None else part
        self.offsets[index] += len(event.text) if not echo_only else 0
        if not (text or logprobs or event.finish_reason):
            return None
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=None)
        if event.finish_reason is not None:
            choice.finish_reason = "length" if echo_only else event.finish_reason  # type: ignore[assignment]
            choice.stop_reason = None if echo_only else event.stop_reason
        return choice
