"""The generation endpoints served past FastAPI (gateway.direct_routes): well-formed
requests are answered by the gateway middleware itself, everything else by FastAPI,
and both paths answer the same request the same way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_fakes import MODEL, Harness, RunningGateway
from starlette.routing import Route

from gateway.app import create_app

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
# Vary per request, not per path.
_VOLATILE = ("id", "created")


def _start(
    harness: Harness, *, direct: bool = True, fastapi_paths: tuple[str, ...] | None = None
) -> RunningGateway:
    """A gateway; `direct=False` serves every request through FastAPI, `fastapi_paths`
    keeps only those generation routes in FastAPI's router."""
    app = create_app(harness.config())
    if not direct:
        middleware = next(m for m in app.user_middleware if "direct" in m.kwargs)
        middleware.kwargs["direct"] = {}
    if fastapi_paths is not None:
        app.router.routes = [
            r
            for r in app.router.routes
            if not (isinstance(r, Route) and r.path in (CHAT, COMPLETIONS) and r.path not in fastapi_paths)
        ]
    return harness.start_app(app)


@pytest.fixture(scope="module")
def both(harness: Harness) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """HTTP clients of a gateway with the direct routes and of one without."""
    direct, via_fastapi = _start(harness), _start(harness, direct=False)
    with (
        httpx.Client(base_url=direct.url, timeout=20) as a,
        httpx.Client(base_url=via_fastapi.url, timeout=20) as b,
    ):
        yield a, b
    harness.stop_gateway(direct)
    harness.stop_gateway(via_fastapi)


def _normalized(value: Any) -> Any:
    """A JSON value without the per-request id and creation time."""
    if isinstance(value, dict):
        return {k: _normalized(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


def _answer(client: httpx.Client, path: str, content: bytes, headers: dict[str, str]) -> tuple[int, str, Any]:
    """Status, content type and normalized body (a list of events for a stream)."""
    reply = client.post(path, content=content, headers=headers)
    ctype = reply.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        body: Any = [_normalized(json.loads(e)) if e != "[DONE]" else e for e in events]
    else:
        body = _normalized(reply.json())
    return reply.status_code, ctype, body


JSON = {"content-type": "application/json"}
_REQUESTS = [
    (COMPLETIONS, {"model": MODEL, "prompt": "hello", "max_tokens": 5}),
    (
        COMPLETIONS,
        {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 4, "n": 2, "echo": True, "logprobs": 2},
    ),
    (COMPLETIONS, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}),
    (
        COMPLETIONS,
        {
            "model": MODEL,
            "prompt": "x",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True}),
    (CHAT, {"model": "no-such-model", "messages": MESSAGES}),  # 404 raised by the endpoint
    (CHAT, {"model": MODEL, "messages": MESSAGES, "temperature": 3}),  # 400 from validation
]


@pytest.mark.parametrize(("path", "body"), _REQUESTS)
def test_direct_and_fastapi_answer_alike(
    both: tuple[httpx.Client, httpx.Client], path: str, body: Any
) -> None:
    direct, via_fastapi = both
    content = json.dumps(body).encode()
    assert _answer(direct, path, content, JSON) == _answer(via_fastapi, path, content, JSON)


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (json.dumps({"model": MODEL, "prompt": "hi"}).encode(), {}),  # no content type
        (json.dumps({"model": MODEL, "prompt": "hi"}).encode(), {"content-type": "text/plain"}),
        (b'{"model": "m", "prompt": ', JSON),  # truncated JSON
        (b"\xff\xfe", JSON),  # not UTF-8
        (b"[1, 2]", JSON),  # not an object
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON),  # too deeply nested to parse
        (b"", JSON),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1}).encode(), JSON),
    ],
)
def test_malformed_requests_are_fastapis_errors(
    both: tuple[httpx.Client, httpx.Client], content: bytes, headers: dict[str, str]
) -> None:
    direct, via_fastapi = both
    answer = _answer(direct, COMPLETIONS, content, headers)
    assert answer[0] == 400
    assert answer == _answer(via_fastapi, COMPLETIONS, content, headers)


def test_well_formed_requests_skip_fastapi_and_malformed_ones_reach_it(harness: Harness) -> None:
    """With FastAPI's /v1/completions route removed, a well-formed request is still
    served (by the middleware) and a malformed one meets FastAPI's 404."""
    gateway = _start(harness, fastapi_paths=(CHAT,))
    try:
        with httpx.Client(base_url=gateway.url, timeout=20) as http:
            for stream in (False, True):
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}
                reply = http.post(COMPLETIONS, json=body)
                assert reply.status_code == 200, reply.text
            assert http.post(COMPLETIONS, content=b"{", headers=JSON).status_code == 404
            assert http.post(CHAT, content=b"{", headers=JSON).status_code == 400
    finally:
        harness.stop_gateway(gateway)
