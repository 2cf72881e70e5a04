"""Server-sent events: encoding an event (templated text chunks included), the SSE
headers and `[DONE]`, and the streaming response that waits for the first output."""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pydantic_core
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.disconnect import ClientDisconnected, until_disconnect
from gateway.errors import APIError
from services import tracing

SSE_DONE = b"data: [DONE]\n\n"


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
                await until_disconnect(receive, self._respond(scope, receive, send))
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
