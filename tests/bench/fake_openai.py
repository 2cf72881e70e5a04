"""A tiny fake OpenAI SSE server (Starlette) for the `bench.serve` tests.

The model name picks the behaviour (see `BEHAVIOURS`).  Every request body is recorded with the
answer text it was given, so tests can check what the load generator sent.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

PROMPT_OVERHEAD = 3  # fake "chat template" tokens added to the reported prompt_tokens


@dataclass(frozen=True)
class Behaviour:
    """How the fake answers one model name."""

    first_delay: float = 0.0
    itl: float = 0.0
    usage: bool = True
    status: int = 200


BEHAVIOURS = {
    "fast": Behaviour(first_delay=0.05, itl=0.01),
    "slow": Behaviour(first_delay=0.25, itl=0.03),
    "nousage": Behaviour(first_delay=0.01, itl=0.002, usage=False),
    "quick": Behaviour(first_delay=0.005, itl=0.001),
    "fail": Behaviour(status=500),
    "hang": Behaviour(first_delay=30.0),
}


@dataclass
class FakeOpenAI:
    """Recorded traffic of the fake server plus its base URL."""

    base_url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        """Forget recorded traffic."""
        with self.lock:
            self.requests.clear()
            self.answers.clear()


def _words(body: dict[str, Any]) -> int:
    """Prompt size in words, as the fake's tokenizer."""
    if "prompt" in body:
        return len(body["prompt"].split())
    total = 0
    for m in body["messages"]:
        c = m["content"]
        total += len(c.split()) if isinstance(c, str) else sum(len(p.get("text", "").split()) for p in c)
    return total


def _event(payload: dict[str, Any]) -> bytes:
    """One SSE data line."""
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _stream(body: dict[str, Any], b: Behaviour, pieces: list[str], chat: bool) -> AsyncIterator[bytes]:
    """Role chunk (chat), then one content chunk per piece, then usage and [DONE]."""
    if chat:
        yield _event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    await asyncio.sleep(b.first_delay)
    for i, piece in enumerate(pieces):
        if i:
            await asyncio.sleep(b.itl)
        choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
        yield _event({"choices": [choice]})
    if b.usage and body.get("stream_options", {}).get("include_usage"):
        usage = {"prompt_tokens": _words(body) + PROMPT_OVERHEAD, "completion_tokens": len(pieces)}
        yield _event({"choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


def make_app(state: FakeOpenAI) -> Starlette:
    """Starlette app serving /v1/chat/completions and /v1/completions."""

    async def handle(request: Request) -> Response:
        """Record the request; answer with an SSE stream or the behaviour's error status."""
        body = await request.json()
        b = BEHAVIOURS[body["model"]]
        with state.lock:
            idx = len(state.requests)
            pieces = [f"a{idx}w{i} " for i in range(int(body["max_tokens"]))]
            state.requests.append(body)
            state.answers.append("".join(pieces))
        if b.status != 200:
            return JSONResponse({"error": {"message": "boom", "type": "internal"}}, status_code=b.status)
        chat = request.url.path.endswith("/chat/completions")
        return StreamingResponse(_stream(body, b, pieces, chat), media_type="text/event-stream")

    routes = [Route(p, handle, methods=["POST"]) for p in ("/v1/chat/completions", "/v1/completions")]
    return Starlette(routes=routes)


def start_fake() -> tuple[FakeOpenAI, uvicorn.Server, threading.Thread]:
    """Serve the fake on 127.0.0.1:<free port> in a daemon thread; return state, server, thread."""
    state = FakeOpenAI()
    config = uvicorn.Config(make_app(state), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake OpenAI server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    state.base_url = f"http://127.0.0.1:{port}"
    return state, server, thread
