"""Unit tests of the gateway's pure pieces: tool-call parsing, rate limiting,
context-length rule, error mapping; and the fake model's tokenizer files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grpc
import pytest
from gateway_fakes import (
    BOS,
    EOS,
    TOKENIZER_CHUNK_BYTES,
    UNICODE_TEXT,
    VOCAB_SIZE,
    decode,
    encode,
    file_chunks,
    write_tokenizer_files,
)

from gateway.errors import APIError, from_mesh_error
from gateway.local_tokenizer import LocalTokenizer
from gateway.protocol import CompletionRequest
from gateway.ratelimit import RateLimiter
from gateway.request_specs import resolve_max_tokens
from gateway.tools import ToolCallStreamParser, parse_tool_calls
from services.errors import Code, MeshError, Overloaded
from tests.fake_clock import FakeClock

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
        piece, deltas = parser.feed(text[start : start + size])
        content += piece
        names += [d.name for d in deltas if d.name]
    content += parser.finish()[0]
    assert content == "Hi <tool <> tail"
    assert names == ["f"] and [c.function.name for c in parser.calls] == ["f"]


def test_stream_parser_holds_back_only_possible_tag_prefixes() -> None:
    parser = ToolCallStreamParser()
    assert parser.feed("abc <tool_c") == ("abc ", [])
    assert parser.feed("x") == ("<tool_cx", [])


def test_rate_limiter_token_bucket() -> None:
    clock = FakeClock()
    limiter = RateLimiter(rate=2.0, burst=2, clock=clock)
    assert limiter.acquire("a") == 0
    assert limiter.acquire("a") == 0
    wait = limiter.acquire("a")
    assert wait == pytest.approx(0.5)
    assert limiter.acquire("b") == 0  # per tenant
    clock.advance(0.4)
    assert limiter.acquire("a") == pytest.approx(0.1)  # not refilled yet
    clock.advance(0.1)
    assert limiter.acquire("a") == 0  # refilled
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


def test_completion_prompt_forms() -> None:
    """Each accepted `prompt` form gives its prompts whole: one list of token ids is one
    prompt; a list of strings or of id lists is one prompt per entry; a mixed list is
    refused by validation."""

    def prompts(prompt: object) -> list[str | list[int]]:
        return CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts()

    ids = list(range(300))
    assert prompts("hi") == ["hi"]
    assert prompts(ids) == [ids]
    assert prompts([0]) == [[0]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1, 2], [3]]) == [[1, 2], [3]]
    assert prompts([]) == []
    for mixed in ([1, "a"], [[1], "a"], [1, [2]], [-1]):
        with pytest.raises(ValueError):
            prompts(mixed)


def test_mesh_error_mapping() -> None:
    error = from_mesh_error(Overloaded("queue full"), "scheduler")
    assert (error.status, error.message, error.headers["Retry-After"]) == (429, "queue full", "1")
    unavailable = MeshError("connection refused")
    unavailable.code = Code.UNAVAILABLE
    error = from_mesh_error(unavailable, "tokenizer")
    assert (error.status, error.message) == (503, "tokenizer: connection refused")
    assert error.body()["error"]["type"] == "service_unavailable_error"
    assert grpc.StatusCode.UNAVAILABLE.name == Code.UNAVAILABLE.value


def test_fake_tokenizer_files_load_as_the_fakes_encode(tmp_path: Path) -> None:
    """The files the fake tokenizer service streams load with AutoTokenizer (as the
    gateway loads them) and agree with the fakes' encode/decode: ASCII is one token per
    character (id = code point + 10), anything else one token per UTF-8 byte."""
    write_tokenizer_files(tmp_path)
    local = LocalTokenizer.load(tmp_path)
    assert local.vocab_size == VOCAB_SIZE and local.eos_token_ids == [EOS]
    for text in ["Hello from choice 0!", UNICODE_TEXT, "a  b\n\tc <|user|>"]:
        ids = encode(text)
        assert ids == [b + 10 for b in text.encode()]
        assert list(local.tokenizer.encode(text, add_special_tokens=False)) == ids
        assert local.decode(ids, skip_special_tokens=True) == decode(ids) == text
    ids = [BOS, *encode("x"), EOS]
    assert local.decode(ids, skip_special_tokens=False) == decode(ids, skip_special=False) == "<s>x</s>"
    assert local.decode(ids, skip_special_tokens=True) == decode(ids) == "x"
    assert local.token_strings([BOS, EOS, ord("H") + 10]) == {BOS: "<s>", EOS: "</s>", ord("H") + 10: "H"}


def test_fake_tokenizer_file_chunks(tmp_path: Path) -> None:
    """GetTokenizer framing of the fake: several chunks, sha256 + size on the last one."""
    path = write_tokenizer_files(tmp_path)[0]
    chunks = list(file_chunks(path))
    data = path.read_bytes()
    assert len(chunks) == -(-len(data) // TOKENIZER_CHUNK_BYTES) > 1
    assert b"".join(c.data for c in chunks) == data
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and chunks[-1].size == len(data)
    assert all(c.name == "tokenizer.json" and not c.sha256 for c in chunks[:-1])
