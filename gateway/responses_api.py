"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is translated into a chat completion request (`gateway.chat_bridge`: the same
rendering, sampling, tool parsing, reasoning parsing and structured outputs) and the
chat result back into a response object or the Responses event stream:

- `input` (a string or items: messages with input_text / output_text parts,
  `function_call`, `function_call_output`; `reasoning` items are skipped) and
  `instructions` (a leading system message, not carried to the next turn) → messages;
  a `function_call_output` must answer a `function_call` of the conversation.
- `tools` (function tools, Responses shape) and `tool_choice` → chat tools; calls →
  `function_call` output items. `text.format` → `response_format`. The reasoning
  parser's `<think>` section → a `reasoning` item. `max_output_tokens` → max tokens;
  cut by it → `status: "incomplete"`.
- `store` (default true) keeps the response and its conversation in the response store
  (`gateway.response_store`, owned by the caller's key) once it completed;
  `previous_response_id` continues that conversation (needs `--redis-url`: every
  replica must see it). Nothing is stored for a failed request.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway import background
from gateway.chat import ChatStreamer
from gateway.chat_bridge import chat_request, named_event, renamed, run_chat
from gateway.errors import APIError
from gateway.multi_run import usage_info
from gateway.protocol import (
    INT32_MAX,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    UsageInfo,
)
from gateway.response_store import ResponseStore, StoredResponse
from gateway.serving import request_context
from gateway.sse import SSE_HEADERS
from gateway.tool_parsers import ToolParser

ROUTE = "/v1/responses"
# Chat request field -> the Responses field a 400 names.
_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` body (unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    background: bool = False


def _new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------ request → chat


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return body.input


def _text_of(content: Any, param: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of content parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"unsupported content part {kind!r}: send input_text", param=f"{param}[{j}]")
        if not isinstance(part.get("text"), str):
            raise APIError(400, "a text part needs a string `text`", param=f"{param}[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"Missing required parameter: '{param}.{name}'.", param=f"{param}.{name}")
    return value


def to_messages(items: list[dict[str, Any]], first_new: int) -> list[dict[str, Any]]:
    """Chat messages of a conversation's items; the items from `first_new` on are the
    request's `input` (their errors name `input[i]`), those before come from the store."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        param = f"input[{i - first_new}]"
        if not isinstance(item, dict):
            raise APIError(400, "an input item must be an object", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"unsupported role {role!r}", param=f"{param}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call_id = _field(item, "call_id", param)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": _field(item, "name", param), "arguments": item.get("arguments") or "{}"},
            }
            calls.add(call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", param)
            if call_id not in calls:
                raise APIError(
                    400, f"No function_call found with call_id {call_id!r}.", param=f"{param}.call_id"
                )
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind != "reasoning":
            raise APIError(400, f"unsupported input item type {kind!r}", param=f"{param}.type")
    return messages


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if body.tools is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise APIError(400, "only function tools are supported", param=f"tools[{i}].type")
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(
            400, 'tool_choice must be a mode or {"type": "function", "name": ...}', param="tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def to_chat(
    body: ResponsesRequest, items: list[dict[str, Any]], first_new: int, max_n: int
) -> ChatCompletionRequest:
    """The chat completion request of `body` over the conversation `items`."""
    messages = to_messages(items, first_new)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise APIError(400, "input must hold at least one message", param="input")
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    optional = {
        "tools": _tools(body),
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "service_tier": body.service_tier,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    return chat_request(fields, _NAMES, max_n)


# ------------------------------------------------------------------ chat → response


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(usage: UsageInfo) -> dict[str, Any]:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


class ResponseBuilder:
    """The response object of one request, from creation (in progress) to its end."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str) -> None:
        self.body, self.id, self.model = body, response_id, model
        self.created_at = int(time.time())

    def object(
        self, status: str, output: list[dict[str, Any]], usage: UsageInfo | None = None
    ) -> dict[str, Any]:
        """The response object with `status` and `output`."""
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": body.background,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": _usage(usage) if usage is not None else None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def from_chat(self, completion: ChatCompletionResponse) -> dict[str, Any]:
        """The finished response of a (non-streamed) chat completion."""
        choice = completion.choices[0]
        message = choice.message
        output = []
        if message.reasoning_content:
            output.append(_reasoning_item(_new_item_id("rs"), message.reasoning_content, "completed"))
        if message.content:
            output.append(_message_item(_new_item_id("msg"), message.content, "completed"))
        for call in message.tool_calls or []:
            fn = call.function
            output.append(_call_item(_new_item_id("fc"), call.id, fn.name, fn.arguments, "completed"))
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return self.object(status, output, completion.usage)


# ------------------------------------------------------------------------- streaming


class ResponsesStreamer:
    """Chat chunks → the Responses event sequence: response.created, .in_progress, then
    per output item `output_item.added`, its content events and `output_item.done`,
    and `response.completed` (or `.incomplete`), each with its `sequence_number`."""

    def __init__(
        self,
        builder: ResponseBuilder,
        on_done: Callable[[dict[str, Any]], Awaitable[None]],
        item_id: Callable[[str], str] | None = None,
    ) -> None:
        """`on_done(response)`: called with the finished response before it is sent;
        `item_id(prefix)`: the id of each new output item (default: random; a background
        response's are numbered, so that a replay names its items alike)."""
        self.builder, self.on_done = builder, on_done
        self.item_id = item_id or _new_item_id
        self.parser: ToolParser | None = None  # the chat's tool-call parser: its calls are complete
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        """One event with the next sequence number."""
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return named_event(kind, payload)

    async def stream(
        self, chunks: AsyncIterator[ChatCompletionChunk], chat: ChatStreamer
    ) -> AsyncIterator[bytes]:
        """The SSE body (an error after the start is an `error` event)."""
        self.parser = chat.parsers[0]
        try:
            start = self.builder.object("in_progress", [])
            yield self.event("response.created", response=start)
            yield self.event("response.in_progress", response=start)
            finish = None
            async for chunk in chunks:
                choice = chunk.choices[0]
                for data in self._delta(choice.delta):
                    yield data
                finish = choice.finish_reason or finish
            for data in self._close():
                yield data
            status = "incomplete" if finish == "length" else "completed"
            final = self.builder.object(status, self.output, usage_info(chat.multi.usage()))
            await self.on_done(final)
            yield self.event(f"response.{status}", response=final)
        except APIError as exc:
            yield self.event("error", code=exc.code, message=exc.message, param=exc.param)

    def _delta(self, delta: Any) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning_content:
            out += self._ensure("reasoning") + self._text_delta(
                "response.reasoning_text.delta", delta.reasoning_content
            )
        if delta.content:
            out += self._ensure("message") + self._text_delta("response.output_text.delta", delta.content)
        for call in delta.tool_calls or []:
            fn = call.function
            if call.id is not None:
                out += self._close()
                item = _call_item(self.item_id("fc"), call.id, fn.name, "", "in_progress")
                out += self._add(item)
            elif fn is not None and fn.arguments and self.open is not None:
                self.text += fn.arguments
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self.open["id"],
                        output_index=len(self.output),
                        delta=fn.arguments,
                    )
                )
        return out

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        assert self.open is not None
        self.text += text
        fields: dict[str, Any] = {
            "item_id": self.open["id"],
            "output_index": len(self.output),
            "content_index": 0,
        }
        if kind == "response.output_text.delta":
            fields["logprobs"] = []
        return [self.event(kind, delta=text, **fields)]

    def _ensure(self, kind: str) -> list[bytes]:
        """Opens an item of `kind` unless one is open."""
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close()
        if kind == "message":
            item = {
                "id": self.item_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            out += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.output),
                    content_index=0,
                    part=part,
                )
            )
        else:
            item = {
                "id": self.item_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            out += self._add(item)
        return out

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.open, self.text = item, ""
        return [self.event("response.output_item.added", output_index=len(self.output), item=item)]

    def _close(self) -> list[bytes]:
        """Ends the open item (a call the parser did not complete, e.g. cut by
        max_output_tokens or given back as text, ends `incomplete`)."""
        item, text = self.open, self.text
        if item is None:
            return []
        self.open, index = None, len(self.output)
        ids = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "message":
            final = _message_item(item["id"], text, "completed")
            out.append(
                self.event("response.output_text.done", content_index=0, text=text, logprobs=[], **ids)
            )
            out.append(
                self.event("response.content_part.done", content_index=0, part=final["content"][0], **ids)
            )
        elif item["type"] == "reasoning":
            final = _reasoning_item(item["id"], text, "completed")
            out.append(self.event("response.reasoning_text.done", content_index=0, text=text, **ids))
        else:
            complete = self.parser is not None and any(c.id == item["call_id"] for c in self.parser.calls)
            final = _call_item(
                item["id"], item["call_id"], item["name"], text, "completed" if complete else "incomplete"
            )
            out.append(
                self.event("response.function_call_arguments.done", name=item["name"], arguments=text, **ids)
            )
        self.output.append(final)
        out.append(self.event("response.output_item.done", output_index=index, item=final))
        return out


# ---------------------------------------------------------------------------- routes


def _store(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.response_store
    return store


async def _previous(store: ResponseStore, owner: str, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation before this request's input: the previous response's items and output."""
    if body.previous_response_id is None:
        return []
    if not store.shared:
        raise APIError(
            400,
            "previous_response_id needs the gateway's --redis-url (conversation state shared by every "
            "gateway replica); send the whole conversation as input instead",
            param="previous_response_id",
        )
    previous = await store.get(owner, body.previous_response_id)
    if previous is None:
        raise APIError(
            404,
            f"Previous response with id '{body.previous_response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return previous.items + previous.response["output"]


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """`POST /v1/responses` (see the module docstring)."""
    ctx = request_context(request)
    store = _store(request)
    items = await _previous(store, ctx.tenant, body)
    first_new = len(items)
    items = items + input_items(body)
    chat = to_chat(body, items, first_new, ctx.config.max_n)
    response_id = _new_item_id("resp")
    builder = ResponseBuilder(body, response_id, "")
    if body.background:
        return await _launch(request, body, chat, items, builder)

    async def on_done(final: dict[str, Any]) -> None:
        if body.store:
            await store.put(ctx.tenant, StoredResponse(response=final, items=items))

    async def collect(completion: ChatCompletionResponse) -> dict[str, Any]:
        builder.model = completion.model
        final = builder.from_chat(completion)
        await on_done(final)
        return final

    def stream(chunks: AsyncIterator[ChatCompletionChunk], streamer: ChatStreamer) -> AsyncIterator[bytes]:
        builder.model = streamer.model
        return ResponsesStreamer(builder, on_done).stream(chunks, streamer)

    return await run_chat(request, chat, response_id, ROUTE, _NAMES, collect, stream)


async def _launch(
    request: Request,
    body: ResponsesRequest,
    chat: ChatCompletionRequest,
    items: list[dict[str, Any]],
    builder: ResponseBuilder,
) -> Response:
    """A background response (gateway.background): queued now, its events logged."""
    if not body.store:
        raise APIError(400, "background responses must be stored: set store to true", param="store")
    ctx = request_context(request)
    chat.model = await ctx.upstream.resolve_model(chat.model)
    job = background.JobRecord(
        tenant=ctx.tenant,
        response_id=builder.id,
        request=body.model_dump(mode="json", exclude_unset=True),
        chat=chat.model_dump(mode="json", exclude_unset=True) | {"model": chat.model},
        items=items,
        created_at=builder.created_at,
    )
    try:
        queued = await request.app.state.background.launch(job, ctx)
    except APIError as exc:
        raise renamed(exc, _NAMES) from None
    if body.stream:
        return _following(_store(request), ctx.tenant, builder.id, -1)
    return JSONResponse(queued)


@dataclass
class _BackgroundPipeline:
    """A background job's translation (gateway.background.Pipeline)."""

    chat: ChatCompletionRequest
    builder: ResponseBuilder
    streamer: ResponsesStreamer

    def snapshot(self, status: str) -> dict[str, Any]:
        return self.builder.object(status, [])

    def events(self, chat: ChatStreamer) -> AsyncIterator[bytes]:
        return self.streamer.stream(chat.chunks(), chat)


def background_pipeline(job: background.JobRecord, store: ResponseStore) -> background.Pipeline:
    """The translation of a background job, on whichever replica produces it: its output
    items are numbered, so that a replay names them as the first run did."""
    body = ResponsesRequest.model_validate(job.request)
    builder = ResponseBuilder(body, job.response_id, job.chat["model"])
    builder.created_at = job.created_at
    numbers = itertools.count()
    suffix = job.response_id.removeprefix("resp_")

    async def on_done(final: dict[str, Any]) -> None:
        await store.put(job.tenant, StoredResponse(final, job.items))

    streamer = ResponsesStreamer(builder, on_done, lambda prefix: f"{prefix}_{suffix}{next(numbers):03d}")
    return _BackgroundPipeline(ChatCompletionRequest.model_validate(job.chat), builder, streamer)


def _following(store: ResponseStore, owner: str, response_id: str, after: int) -> Response:
    """The SSE stream of a background response's events after ``after``."""
    return StreamingResponse(
        store.follow_events(owner, response_id, after),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def retrieve_response(
    response_id: str, request: Request, stream: bool = False, starting_after: int | None = None
) -> Response:
    """`GET /v1/responses/{id}`: a stored response of the caller, else 404; with
    ``stream`` (a background response) its events after ``starting_after``, then the
    rest as they come, from whichever replica produces them."""
    store, owner = _store(request), request_context(request).tenant
    found = await store.get(owner, response_id)
    if found is None:
        raise _not_found(response_id)
    if not stream:
        return JSONResponse(found.response)
    if not found.response.get("background"):
        raise APIError(400, "only background responses can be streamed again", param="stream")
    if starting_after is not None and starting_after < 0:
        raise APIError(400, "starting_after must be >= 0", param="starting_after")
    return _following(store, owner, response_id, -1 if starting_after is None else starting_after)


async def cancel_response(response_id: str, request: Request) -> Response:
    """`POST /v1/responses/{id}/cancel`: stops a background response of the caller (from
    any replica) and answers it; one that has ended is answered unchanged."""
    store, owner = _store(request), request_context(request).tenant
    found = await store.get(owner, response_id)
    if found is None:
        raise _not_found(response_id)
    if not found.response.get("background"):
        raise APIError(400, "only background responses can be cancelled", param="response_id")
    return JSONResponse(await background.cancel(store, owner, found))


async def delete_response(response_id: str, request: Request) -> Response:
    """`DELETE /v1/responses/{id}`: deletes a stored response of the caller, else 404."""
    if not await _store(request).delete(request_context(request).tenant, response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found"
    )
