"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request is translated into a chat completion request (`gateway.chat_bridge`) and the
chat result back into a message or the Messages event stream:

- `system` (a string or text blocks) → a leading system message; `messages` with text,
  `tool_use` and `tool_result` blocks → user / assistant (tool calls) / tool messages
  (a `tool_result` must answer a `tool_use` of an earlier message); `thinking` blocks of
  the history are dropped; other blocks (images, documents) are refused.
- `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k`;
  `tools` (name, description, input_schema) and `tool_choice` (auto, any → required,
  tool → a named function, none); `metadata` and `thinking` are ignored.
- Result: `thinking` (the reasoning parser's section), `text` and `tool_use` blocks;
  `stop_reason` end_turn / max_tokens / stop_sequence (with `stop_sequence`) / tool_use.
- Errors have Anthropic's shape (`gateway.errors`); `x-api-key` is accepted like a
  bearer key (`gateway.middleware`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from gateway.chat import ChatStreamer, render_request
from gateway.chat_bridge import chat_request, named_event, run_chat
from gateway.errors import APIError
from gateway.protocol import (
    INT32_MAX,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    StopString,
)
from gateway.serving import request_context
from gateway.upstream import TOKENIZER

ROUTE = "/v1/messages"
# Chat request field -> the Messages field a 400 names.
_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


class MessagesRequest(BaseModel):
    """`POST /v1/messages` body (unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[StopString] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    service_tier: str | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens` body: a Messages request without max_tokens."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


# ------------------------------------------------------------------ request → chat


def _block_text(block: Any, param: str) -> str:
    """The text of a text block (`param` names the block)."""
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise APIError(400, "only text blocks are supported here", param=param)
    return str(block["text"])


def _text(blocks: Any, param: str) -> str:
    """Text of a string or of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, "must be a string or a list of text blocks", param=param)
    return "".join(_block_text(block, f"{param}.{j}") for j, block in enumerate(blocks))


def _assistant(blocks: list[Any], param: str) -> dict[str, Any]:
    text, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_block_text(block, f"{param}.{j}"))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise APIError(400, "a tool_use block needs an id and a name", param=f"{param}.{j}")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(400, f"unsupported content block type {kind!r}", param=f"{param}.{j}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Any], param: str, calls: set[str]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_block_text(block, f"{param}.{j}"))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if call_id not in calls:
                raise APIError(
                    400,
                    f"tool_result block has no matching tool_use block (tool_use_id {call_id!r})",
                    param=f"{param}.{j}.tool_use_id",
                )
            content = block.get("content") or ""
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _text(content, f"{param}.{j}.content")}
            )
        else:
            raise APIError(400, f"unsupported content block type {kind!r}", param=f"{param}.{j}.type")
    if text:
        messages.append({"role": "user", "content": "".join(text)})
    return messages


def to_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """Chat messages of `system` and `messages`."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    calls: set[str] = set()
    for i, message in enumerate(body.messages):
        param = f"messages.{i}"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"role must be user or assistant, got {role!r}", param=f"{param}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, "content must be a string or a list of blocks", param=f"{param}.content")
        if role == "assistant":
            out.append(_assistant(content, f"{param}.content"))
            calls.update(c["id"] for c in out[-1].get("tool_calls", []))
        else:
            out.extend(_user(content, f"{param}.content", calls))
    return out


def _tools(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]] | None:
    if body.tools is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if not isinstance(tool.get("name"), str):
            raise APIError(400, "a tool needs a name (custom tools only)", param=f"tools.{i}.name")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(body: MessagesRequest | CountTokensRequest) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of `tool_choice`."""
    choice = body.tool_choice
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, "tool_choice.type must be auto, any, tool (with name) or none", param="tool_choice")


def to_chat(body: MessagesRequest | CountTokensRequest, max_n: int) -> ChatCompletionRequest:
    """The chat completion request of `body`."""
    choice, parallel = _tool_choice(body)
    fields: dict[str, Any] = {"model": body.model, "messages": to_messages(body)}
    if isinstance(body, MessagesRequest):
        fields |= {"stream": body.stream, "max_completion_tokens": body.max_tokens}
        fields |= {
            k: getattr(body, k)
            for k in ("temperature", "top_p", "top_k", "service_tier")
            if getattr(body, k) is not None
        }
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
    optional = {"tools": _tools(body), "tool_choice": choice, "parallel_tool_calls": parallel}
    fields.update({k: v for k, v in optional.items() if v is not None})
    return chat_request(fields, _NAMES, max_n)


# ------------------------------------------------------------------ chat → message


def stop_reason(finish: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason and vLLM stop reason."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {}


def _message(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: tuple[str | None, str | None],
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage,
    }


def from_chat(message_id: str, completion: ChatCompletionResponse) -> dict[str, Any]:
    """The Messages response of a (non-streamed) chat completion."""
    choice = completion.choices[0]
    message = choice.message
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls or []:
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.function.name,
                "input": _input(call.function.arguments),
            }
        )
    usage = {
        "input_tokens": completion.usage.prompt_tokens,
        "output_tokens": completion.usage.completion_tokens,
    }
    reason = stop_reason(choice.finish_reason, choice.stop_reason)
    return _message(message_id, completion.model, blocks, reason, usage)


class MessagesStreamer:
    """Chat chunks → the Messages event sequence: message_start, then per content block
    content_block_start (a ping after the first), its deltas and content_block_stop,
    then message_delta (stop_reason, usage) and message_stop."""

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self.index = -1
        self.open: str | None = None  # type of the open block
        self.pinged = False

    async def stream(
        self, chunks: AsyncIterator[ChatCompletionChunk], chat: ChatStreamer
    ) -> AsyncIterator[bytes]:
        """The SSE body (an error after the start is an `error` event)."""
        try:
            usage = {"input_tokens": chat.multi.usage().prompt_tokens, "output_tokens": 0}
            start = _message(self.message_id, chat.model, [], (None, None), usage)
            yield named_event("message_start", {"type": "message_start", "message": start})
            finish: tuple[str | None, int | str | None] = (None, None)
            async for chunk in chunks:
                choice = chunk.choices[0]
                for data in self._delta(choice.delta):
                    yield data
                if choice.finish_reason is not None:
                    finish = (choice.finish_reason, choice.stop_reason)
            for data in self._close() + self._ping():
                yield data
            reason, sequence = stop_reason(*finish)
            final = chat.multi.usage()
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            usage = {"input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens}
            yield named_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
            yield named_event("message_stop", {"type": "message_stop"})
        except APIError as exc:
            yield named_event("error", exc.anthropic_body())

    def _delta(self, delta: Any) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning_content:
            out += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self._block_delta({"type": "thinking_delta", "thinking": delta.reasoning_content})
        if delta.content:
            out += self._ensure("text", {"type": "text", "text": ""})
            out += self._block_delta({"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls or []:
            fn = call.function
            if call.id is not None:
                out += self._close()
                out += self._ensure(
                    "tool_use", {"type": "tool_use", "id": call.id, "name": fn.name, "input": {}}
                )
            elif fn is not None and fn.arguments:
                out += self._block_delta({"type": "input_json_delta", "partial_json": fn.arguments})
        return out

    def _block_delta(self, delta: dict[str, Any]) -> list[bytes]:
        return [
            named_event(
                "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
            )
        ]

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.open == kind and kind != "tool_use":
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(
            named_event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        )
        return out + self._ping()

    def _ping(self) -> list[bytes]:
        if self.pinged:
            return []
        self.pinged = True
        return [named_event("ping", {"type": "ping"})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


# ---------------------------------------------------------------------------- routes


async def create_message(body: MessagesRequest, request: Request) -> Response:
    """`POST /v1/messages` (see the module docstring)."""
    chat = to_chat(body, request_context(request).config.max_n)
    message_id = f"msg_{uuid.uuid4().hex}"

    async def collect(completion: ChatCompletionResponse) -> dict[str, Any]:
        return from_chat(message_id, completion)

    def stream(chunks: AsyncIterator[ChatCompletionChunk], streamer: ChatStreamer) -> AsyncIterator[bytes]:
        return MessagesStreamer(message_id).stream(chunks, streamer)

    return await run_chat(request, chat, message_id, ROUTE, _NAMES, collect, stream)


async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """`POST /v1/messages/count_tokens`: the prompt's tokens as `create` would render it."""
    ctx = request_context(request)
    chat = to_chat(body, ctx.config.max_n)
    model = await ctx.upstream.resolve_model(chat.model)
    upstream = ctx.upstream
    rendered = await upstream.call(
        TOKENIZER, upstream.tokenizer.RenderChat(render_request(chat, model), timeout=upstream.timeout)
    )
    return JSONResponse({"input_tokens": len(rendered.prompt_token_ids)})
