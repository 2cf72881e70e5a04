"""What the Responses and Messages APIs share on their way through the chat path: their
request translated into a `ChatCompletionRequest` (validated and checked like a chat
request, errors naming the caller's own fields), the chat run started, collected or
streamed (`gateway.chat`), and SSE events with an `event:` line."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import pydantic
from fastapi import Request, Response
from fastapi.responses import JSONResponse

from gateway.answers import StartedRequest
from gateway.chat import ChatCollector, ChatStreamer, start_chat
from gateway.errors import APIError, param_from_loc
from gateway.protocol import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse
from gateway.serving import Generation, request_context, respond
from gateway.sse import escape_line_breaks
from services import tracing


def chat_request(fields: dict[str, Any], names: Mapping[str, str], max_n: int) -> ChatCompletionRequest:
    """`fields` as a checked chat request; a 400 names the caller's field (`names` maps
    a chat field to it, e.g. max_completion_tokens -> max_output_tokens)."""
    try:
        body = ChatCompletionRequest.model_validate(fields)
        body.check(max_n)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = param_from_loc(first.get("loc", ()))
        raise renamed(APIError(400, str(first.get("msg")), param=param), names) from None
    except APIError as exc:
        raise renamed(exc, names) from None
    return body


def renamed(exc: APIError, names: Mapping[str, str]) -> APIError:
    """`exc` with its param in the caller's naming (an error of the chat path)."""
    if exc.param:
        head = re.split(r"[.\[]", exc.param, maxsplit=1)[0]
        exc.param = names.get(head, head) + exc.param[len(head) :]
    return exc


ChunkHandler = Callable[[AsyncIterator[ChatCompletionChunk], ChatStreamer], AsyncIterator[bytes]]
Finisher = Callable[[ChatCompletionResponse], Awaitable[dict[str, Any]]]


async def run_chat(
    request: Request,
    body: ChatCompletionRequest,
    request_id: str,
    route: str,
    names: Mapping[str, str],
    collect: Finisher,
    stream: ChunkHandler,
) -> Response:
    """Runs `body` on the chat path: `collect` turns the chat completion into the API's
    answer, `stream` turns the chat chunks into the API's SSE events; errors of the
    chat path name the caller's fields (`names`)."""
    ctx = request_context(request)
    model = await ctx.upstream.resolve_model(body.model)
    body.model = model

    async def start() -> Generation[Response]:
        try:
            multi = await start_chat(ctx, body, model, request_id)
        except APIError as exc:
            raise renamed(exc, names) from None

        started = StartedRequest(ctx, request_id, model, multi)

        async def collected() -> Response:
            completion = await ChatCollector(started, body, route).collect()
            return JSONResponse(await collect(completion))

        def streamed() -> AsyncIterator[bytes]:
            streamer = ChatStreamer(started, body, route)
            return stream(streamer.chunks(), streamer)

        return Generation(multi, stream=streamed, collect=collected)

    span = tracing.PhaseSpan("gateway." + route.rsplit("/", 1)[-1], model=model, request_id=request_id)
    return await respond(request, span, start, body.stream)


def named_event(kind: str, payload: dict[str, Any]) -> bytes:
    """One SSE event with its type on an `event:` line (the Responses and Messages APIs)."""
    data = escape_line_breaks(json.dumps(payload, ensure_ascii=False).encode())
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
