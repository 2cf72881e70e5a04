"""Unit tests of the gateway's pure pieces: tool-call parsing, rate limiting,
context-length rule, error mapping."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.errors import APIError, from_mesh_error
from gateway.ratelimit import RateLimiter
from gateway.serving import resolve_max_tokens
from gateway.tools import ToolCallStreamParser, parse_tool_calls
from services.errors import Code, MeshError, Overloaded

CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def test_parse_tool_calls_whole_text() -> None:
    content, calls = parse_tool_calls(f"before {CALL} after {CALL}")
    assert content == "before  after"
    assert [c.function.name for c in calls] == ["f", "f"]
    assert json.loads(calls[0].function.arguments) == {"x": 1}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert parse_tool_calls(CALL)[0] is None  # no text outside the block → null content


def test_parse_tool_calls_keeps_invalid_blocks_as_text() -> None:
    text = "x <tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    unclosed = 'x <tool_call>{"name": "f"'
    assert parse_tool_calls(unclosed) == (unclosed, [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_stream_parser_any_split(size: int) -> None:
    text = f"Hi <tool <{CALL}> tail"
    parser = ToolCallStreamParser()
    content, names = "", []
    for start in range(0, len(text), size):
        piece, calls = parser.feed(text[start : start + size])
        content += piece
        names += [c.function.name for c in calls]
    content += parser.flush()
    assert content == "Hi <tool <> tail"
    assert names == ["f"] and parser.calls_emitted == 1


def test_stream_parser_holds_back_only_possible_tag_prefixes() -> None:
    parser = ToolCallStreamParser()
    assert parser.feed("abc <tool_c") == ("abc ", [])
    assert parser.feed("x") == ("<tool_cx", [])


def test_rate_limiter_token_bucket() -> None:
    limiter = RateLimiter(rate=2.0, burst=2)
    assert limiter.acquire("a", now=0.0) == 0
    assert limiter.acquire("a", now=0.0) == 0
    wait = limiter.acquire("a", now=0.0)
    assert wait == pytest.approx(0.5)
    assert limiter.acquire("b", now=0.0) == 0  # per tenant
    assert limiter.acquire("a", now=0.5) == 0  # refilled
    assert RateLimiter(rate=0).acquire("a") == 0  # off
    assert RateLimiter.retry_after_header(0.2) == "1"


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(10, None, 100, 256, "messages") == 90
    assert resolve_max_tokens(10, None, 1000, 256, "messages") == 256
    assert resolve_max_tokens(10, 90, 100, 256, "messages") == 90
    with pytest.raises(APIError) as info:
        resolve_max_tokens(10, 91, 100, 256, "messages")
    assert info.value.param == "max_tokens" and "maximum context length is 100" in info.value.message
    with pytest.raises(APIError) as info:
        resolve_max_tokens(100, None, 100, 256, "prompt")
    assert info.value.param == "prompt"
    assert resolve_max_tokens(10, None, 0, 256, "prompt") == 256  # unknown limit


def test_mesh_error_mapping() -> None:
    error = from_mesh_error(Overloaded("queue full"), "scheduler")
    assert (error.status, error.message, error.headers["Retry-After"]) == (429, "queue full", "1")
    unavailable = MeshError("connection refused")
    unavailable.code = Code.UNAVAILABLE
    error = from_mesh_error(unavailable, "tokenizer")
    assert (error.status, error.message) == (503, "tokenizer: connection refused")
    assert error.body()["error"]["type"] == "service_unavailable_error"
    assert grpc.StatusCode.UNAVAILABLE.name == Code.UNAVAILABLE.value
