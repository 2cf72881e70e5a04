"""`POST /v1/chat/completions`: RenderChat → context check → route + worker stream (`generation.py`)
→ OpenAI chat completion (JSON) or chunks (SSE).

Tools: with `tools` and tool_choice "auto" (or unset) the output is parsed by the
model's tool-call parser (`--tool-call-parser`, gateway.tool_parsers: Hermes/Qwen,
Llama 3 JSON, Mistral); finish_reason becomes "tool_calls" when a call was parsed and
the model stopped normally; streamed calls go out as OpenAI sends them: a header (id,
type, name, arguments "") once the name is known, then the arguments text in fragments
as it arrives (gateway.tool_parsers.base; a call cut short is never completed). With `--reasoning-parser` the `<think>` section goes to `reasoning_content`
(gateway.reasoning) before tool parsing. tool_choice "required" or a
named function is enforced with structured outputs (gateway.structured): the output is
the calls' JSON, always parsed into tool calls (streamed the same way, gateway.tools).

response_format json_object / json_schema and `structured_outputs` are enforced by the
worker while sampling. A json_object choice that does not parse (cut by max_tokens) is
returned unchanged, logged and counted in `meshserve_gateway_json_mode_violations_total`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Iterable

from fastapi import Request, Response

from gateway import metrics, reasoning, tool_parsers
from gateway.answers import ChoiceCollector, ChoiceOutput, ChoiceStreamer, StartedRequest, serve
from gateway.errors import APIError
from gateway.generation import ChoiceEvent, GenerationRun
from gateway.logprobs import chat_logprobs, resolve_strings, vllm_prompt_logprobs
from gateway.multi_run import MultiRun, usage_info
from gateway.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    NamedToolChoice,
    ToolCall,
)
from gateway.request_specs import generation_spec, resolve_max_tokens, sampling_params
from gateway.serving import Generation, RequestContext
from gateway.sse import TextChunkTemplate, sse_event
from gateway.tool_parsers import ToolCallDelta, ToolParser, parse_whole
from gateway.tools import forced_tool_parser
from gateway.upstream import TOKENIZER
from meshserve.v1 import tokenizer_pb2

log = logging.getLogger(__name__)
ROUTE = "/v1/chat/completions"


def render_request(body: ChatCompletionRequest, model: str) -> tokenizer_pb2.RenderChatRequest:
    """The tokenizer's RenderChat request for `body`."""
    messages = [m.model_dump(exclude_unset=True) for m in body.messages]
    request = tokenizer_pb2.RenderChatRequest(
        model=model,
        messages_json=json.dumps(messages, ensure_ascii=False),
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
    )
    if "add_generation_prompt" in body.model_fields_set:
        request.add_generation_prompt = body.add_generation_prompt
    else:
        request.add_generation_prompt = not body.continue_final_message
    if body.tools:
        request.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in body.tools])
    if body.tool_choice is not None:
        choice = body.tool_choice
        value = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
        request.tool_choice_json = json.dumps(value)
    if body.chat_template is not None:
        request.chat_template = body.chat_template
    if body.chat_template_kwargs:
        request.chat_template_kwargs_json = json.dumps(body.chat_template_kwargs)
    return request


async def start_chat(
    ctx: RequestContext, body: ChatCompletionRequest, model: str, request_id: str
) -> MultiRun:
    """Renders the prompt, checks the context length and starts generation."""
    upstream = ctx.upstream
    rendered, info = await asyncio.gather(
        upstream.call(
            TOKENIZER,
            upstream.tokenizer.RenderChat(
                render_request(body, upstream.tokenizer_model(model)), timeout=upstream.timeout
            ),
        ),
        upstream.tokenizer_info(model),
    )
    prompt_ids = list(rendered.prompt_token_ids)
    if not prompt_ids:
        raise APIError(400, "the rendered prompt is empty", param="messages")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(
        len(prompt_ids),
        body.requested_max_tokens(),
        info.max_model_len,
        ctx.config.default_max_tokens,
        "messages",
        max_param,
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = sampling_params(body, max_tokens, logprobs)
    spec = generation_spec(ctx, body, request_id, model, prompt_ids, list(rendered.mm_items), sampling)
    if (
        body.tools_enabled()
        and tool_parser_name(ctx, model) in tool_parsers.NEEDS_SPECIAL_TOKENS
        and "skip_special_tokens" not in body.model_fields_set
    ):
        # The parser's markers ([TOOL_CALLS], <|python_tag|>) are special tokens.
        spec = dataclasses.replace(spec, skip_special_tokens=False)
    multi = MultiRun([GenerationRun(upstream, spec)], body.n)
    await multi.reserve(ctx)
    multi.start()
    return multi


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletionResponse | Response:
    """Route handler (see module docstring)."""

    async def start(ctx: RequestContext, model: str, request_id: str) -> Generation[ChatCompletionResponse]:
        started = StartedRequest(ctx, request_id, model, await start_chat(ctx, body, model, request_id))
        return started.answered_by(ChatStreamer, ChatCollector, body, ROUTE)

    return await serve(request, body, "chatcmpl", "gateway.chat_completions", start)


def tool_parser_name(ctx: RequestContext, model: str) -> str:
    """The tool-call parser configured for `model` (--tool-call-parser)."""
    return tool_parsers.parser_name_for(ctx.config.tool_call_parser, model)


def new_tool_parser(ctx: RequestContext, model: str) -> ToolParser:
    """A fresh parser of `model`'s tool-call format, for one choice."""
    return tool_parsers.PARSERS[tool_parser_name(ctx, model)]()


def check_json_output(text: str, request_id: str, index: int) -> None:
    """json_object mode: warn (and count) when a choice's text is not valid JSON."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        metrics.JSON_MODE_VIOLATIONS.inc()
        log.warning(
            "%s choice %d: response_format json_object but output is not JSON (%s)", request_id, index, exc
        )


class ChatCollector(ChoiceCollector[ChatCompletionRequest]):
    """Builds the non-streamed response."""

    async def collect(self) -> ChatCompletionResponse:
        """Consumes every event and assembles the response."""
        body = self.body
        choices, usage, strings = await self.gather(True, bool(body.logprobs), body.top_logprobs or 0)
        response = ChatCompletionResponse(
            **self.head(),
            choices=[self._choice(i, acc, strings) for i, acc in enumerate(choices)],
            usage=usage_info(usage),
        )
        if self.body.prompt_logprobs is not None:  # vLLM: on the response, not per choice
            _, prompt = self.multi.prompt_logprobs(0)
            response.prompt_logprobs = await vllm_prompt_logprobs(
                self.ctx.upstream, self.model, prompt, self.body.prompt_logprobs
            )
        return response

    def _choice(self, index: int, acc: ChoiceOutput, strings: dict[int, str]) -> ChatChoice:
        text = "".join(acc.text)
        thoughts = None
        if self.ctx.config.reasoning_parser:
            thoughts, rest = reasoning.split(self.ctx.config.reasoning_parser, text)
            text = rest or ""
        if self.body.response_format is not None and self.body.response_format.type == "json_object":
            check_json_output(text, self.request_id, index)
        content: str | None = text
        calls: list[ToolCall] = []
        if self.body.forced_tools():
            content, calls = parse_whole(forced_tool_parser(self.body), text)
        elif self.body.tools_enabled():
            content, calls = parse_whole(new_tool_parser(self.ctx, self.model), text)
        if thoughts is not None and not content:
            content = None
        finish = acc.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        logprobs = None
        if self.body.logprobs:
            logprobs = ChatLogprobs(content=chat_logprobs(acc.logprobs, strings, self.body.top_logprobs or 0))
        return ChatChoice(
            index=index,
            message=ChatResponseMessage(
                content=content, reasoning_content=thoughts, tool_calls=calls or None
            ),
            logprobs=logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
            stop_reason=acc.stop_reason,
        )


class ChatStreamer(ChoiceStreamer[ChatCompletionRequest, ChatCompletionChunk]):
    """Turns events into chat completion chunks (SSE): every choice's role chunk first."""

    chunk_type = ChatCompletionChunk

    def __init__(self, started: StartedRequest, body: ChatCompletionRequest, route: str) -> None:
        super().__init__(started, body, route)
        tools, forced = body.tools_enabled(), body.forced_tools()
        self.parsers: list[ToolParser | None] = [
            forced_tool_parser(body) if forced else new_tool_parser(self.ctx, self.model) if tools else None
            for _ in range(body.n)
        ]
        name = self.ctx.config.reasoning_parser
        self.reasoners = [reasoning.ReasoningParser(name) if name else None for _ in range(body.n)]
        self.json_mode = body.response_format is not None and body.response_format.type == "json_object"
        self.forced = forced
        self.texts: list[list[str]] = [[] for _ in range(body.n)]
        # Built now, before the first token (the stream is created during the prefill):
        # the role chunks, and the content templates of the choices without parsers.
        plain = not (self.continuous_usage or body.logprobs or self.json_mode or self.forced)
        self._templates = {
            index: self._template(index)
            for index in range(body.n)
            if plain and self.parsers[index] is None and self.reasoners[index] is None
        }
        # (With running usage a role chunk is built when sent: the usage is that moment's.)
        self._role_events = [] if self.continuous_usage else [self._role_event(i) for i in range(body.n)]

    def _template(self, index: int) -> TextChunkTemplate:
        return TextChunkTemplate(
            lambda text: self.chunk(
                [
                    ChatChunkChoice(
                        index=index, delta=DeltaMessage(content=text), logprobs=None, finish_reason=None
                    )
                ]
            )
        )

    def _role_event(self, index: int) -> bytes:
        delta = DeltaMessage(role="assistant", content="")
        return sse_event(
            self.chunk([ChatChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=None)])
        )

    def opening(self) -> Iterable[bytes]:
        """Every choice's role chunk, in one write."""
        return [b"".join(self._role_events or [self._role_event(i) for i in range(self.body.n)])]

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        """The content, reasoning and tool-call chunks of every event (no role or usage
        chunk): what the Responses and Messages APIs translate into their own events.
        Errors propagate."""
        async for event in self.multi.events():
            for chunk in await self.on_event(event):
                yield chunk
        usage = self.multi.usage()
        self.timer.finish(usage.prompt_tokens, usage.completion_tokens)

    async def on_event(self, event: ChoiceEvent) -> list[ChatCompletionChunk]:
        """The chunks of one event (none when it carries nothing to send): text and
        reasoning first, then the tool-call deltas as OpenAI streams them (a call's header
        with its id, type, name and empty arguments, then its arguments fragments); the
        last chunk carries the finish reason."""
        self.timer.on_output(len(event.token_ids))
        thoughts, text = self._split_reasoning(event)
        parser = self.parsers[event.index]
        content, calls = parser.feed(text) if parser is not None else (text, [])
        if event.finish_reason is not None and parser is not None:
            tail, more = parser.finish()
            content, calls = content + tail, calls + more
        if self.json_mode:
            self.texts[event.index].append(event.text)
        logprobs = None
        if self.body.logprobs and event.logprobs:
            top_k = self.body.top_logprobs or 0
            strings = await resolve_strings(self.ctx.upstream, self.model, event.logprobs, top_k)
            logprobs = ChatLogprobs(content=chat_logprobs(event.logprobs, strings, top_k))
        if not (content or calls or logprobs or event.finish_reason or thoughts):
            return []
        deltas = []
        if thoughts or content or not calls:
            delta = DeltaMessage()
            if thoughts:
                delta.reasoning_content = thoughts
            if content or not thoughts:
                delta.content = content
            deltas.append(delta)
        deltas.extend(_call_deltas(calls))
        choices = [
            ChatChunkChoice(index=event.index, delta=d, logprobs=None, finish_reason=None) for d in deltas
        ]
        choices[0].logprobs = logprobs
        if event.finish_reason is not None:
            self._finish(choices[-1], event, parser)
        return [self.chunk([choice]) for choice in choices]

    def _split_reasoning(self, event: ChoiceEvent) -> tuple[str, str]:
        """(reasoning, content) of the event's text through the choice's reasoning parser."""
        parser = self.reasoners[event.index]
        if parser is None:
            return "", event.text
        thoughts, text = parser.feed(event.text)
        if event.finish_reason is not None:
            more_t, more_c = parser.finish()
            thoughts, text = thoughts + more_t, text + more_c
        return thoughts, text

    def _finish(self, choice: ChatChunkChoice, event: ChoiceEvent, parser: ToolParser | None) -> None:
        reason = event.finish_reason
        if self.forced and reason == "stop":
            reason = "tool_calls"
        if parser is not None and parser.calls and reason == "stop":
            reason = "tool_calls"
        choice.finish_reason = reason  # type: ignore[assignment]
        choice.stop_reason = event.stop_reason
        if self.json_mode:
            check_json_output("".join(self.texts[event.index]), self.request_id, event.index)


def _call_deltas(calls: list[ToolCallDelta]) -> list[DeltaMessage]:
    """Tool-call deltas as OpenAI streams them: a call's header (id, type, name,
    arguments ""), then its arguments fragments (consecutive ones merged)."""
    deltas: list[DeltaMessage] = []
    last: DeltaToolCall | None = None
    for call in calls:
        if call.id is None and last is not None and last.index == call.index and last.id is None:
            assert last.function is not None
            last.function.arguments = (last.function.arguments or "") + call.arguments
            continue
        if call.id is not None:
            function = DeltaFunctionCall(name=call.name, arguments="")
            last = DeltaToolCall(index=call.index, id=call.id, type="function", function=function)
        else:
            last = DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))
        deltas.append(DeltaMessage(tool_calls=[last]))
    return deltas
