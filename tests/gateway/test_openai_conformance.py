"""Every response and chunk kind the gateway produces validates against the `openai`
package's pydantic types (OpenAI's OpenAPI spec) in strict mode, with no field the spec
does not define except the vLLM extensions listed in `EXTENSIONS`.

The bodies are read raw (httpx), not through the client: the client's own parsing is
lenient (it never rejects a missing `object`), which is what let chunks without it pass.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from gateway_fakes import MODEL
from openai.types import Completion, CreateEmbeddingResponse, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject
from pydantic import BaseModel

# vLLM extension fields the gateway sends on top of OpenAI's (by the model they appear in).
EXTENSIONS = {
    "stop_reason",  # choices: the stop string / token id that ended a choice
    "reasoning_content",  # message / delta: text of a reasoning (<think>) section
    "prompt_logprobs",  # completion choices, chat responses: per prompt token, when asked for
    "root",  # model cards
    "parent",
    "max_model_len",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def no_extras(model: BaseModel, path: str = "$") -> None:
    """Fails on any field the spec type does not define (OpenAI's types allow extras, so
    strict validation alone would accept them), recursively."""
    extra = set(model.model_extra or {}) - EXTENSIONS
    assert not extra, f"{path}: fields not in the OpenAI spec: {sorted(extra)}"
    for name in type(model).model_fields:
        _walk(getattr(model, name), f"{path}.{name}")


def _walk(value: Any, path: str) -> None:
    if isinstance(value, BaseModel):
        no_extras(value, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]")


def strict(kind: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """`data` validated strictly as `kind` with no unknown fields."""
    model = kind.model_validate(data, strict=True)
    no_extras(model)
    return model


def sse_payloads(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of an SSE body (which must end with [DONE])."""
    events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-200:]
    return [json.loads(e) for e in events[:-1]]


def _chat(http: httpx.Client, **body: Any) -> httpx.Response:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    response = http.post("/v1/chat/completions", json={**base, **body})
    assert response.status_code == 200, response.text
    return response


CHAT_BODIES = {
    "plain": {"temperature": 0.5},
    "n2_logprobs": {"n": 2, "logprobs": True, "top_logprobs": 2},
    "tools": {"messages": [{"role": "user", "content": "TOOL"}], "tools": TOOLS},
    "json_object": {
        "messages": [{"role": "user", "content": "JSON"}],
        "response_format": {"type": "json_object"},
    },
    "stop_string": {"stop": ["quick"]},
    # the fake model answers '{"answer": 42}': the named function's arguments
    "forced_tool": {
        "messages": [{"role": "user", "content": "JSON"}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
}


@pytest.mark.parametrize("name", sorted(CHAT_BODIES))
def test_chat_completion_conforms(http: httpx.Client, name: str) -> None:
    data = _chat(http, **CHAT_BODIES[name]).json()
    assert data["object"] == "chat.completion"
    strict(ChatCompletion, data)
    if name in ("tools", "forced_tool"):
        assert (
            data["choices"][0]["finish_reason"] == "tool_calls"
            and data["choices"][0]["message"]["tool_calls"]
        )


STREAM_BODIES = {
    **CHAT_BODIES,
    "usage": {"n": 2, "stream_options": {"include_usage": True}},
    "continuous_usage": {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
}


@pytest.mark.parametrize("name", sorted(STREAM_BODIES))
def test_chat_chunks_conform(http: httpx.Client, name: str) -> None:
    chunks = sse_payloads(_chat(http, stream=True, **STREAM_BODIES[name]))
    assert len(chunks) > 2
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk", chunk
        strict(ChatCompletionChunk, chunk)
    if "usage" in name:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    if name in ("tools", "forced_tool"):  # a header, then argument fragments
        calls = [
            c
            for chunk in chunks
            for choice in chunk["choices"]
            for c in choice["delta"].get("tool_calls") or []
        ]
        assert calls[0]["id"] and len(calls) > 2 and not any(c.get("id") for c in calls[1:])


COMPLETION_BODIES = {
    "plain": {"prompt": "hi"},
    "batch_echo": {"prompt": ["hi", "there"], "echo": True, "n": 2},
    "logprobs": {"prompt": "hi", "logprobs": 2},
    "token_prompt": {"prompt": [104, 105]},
}


@pytest.mark.parametrize("name", sorted(COMPLETION_BODIES))
def test_completion_conforms(http: httpx.Client, name: str) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, **COMPLETION_BODIES[name]})
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "text_completion"
    strict(Completion, response.json())


@pytest.mark.parametrize("name", [*sorted(COMPLETION_BODIES), "usage"])
def test_completion_chunks_conform(http: httpx.Client, name: str) -> None:
    body = COMPLETION_BODIES.get(name, {"prompt": "hi", "stream_options": {"include_usage": True}})
    response = http.post("/v1/completions", json={"model": MODEL, "stream": True, **body})
    assert response.status_code == 200, response.text
    chunks = sse_payloads(response)
    assert len(chunks) > 2
    for chunk in chunks:
        # OpenAI streams completion chunks as `Completion` objects ("text_completion").
        assert chunk["object"] == "text_completion", chunk
        strict(Completion, _unfinished_as_stop(chunk))


def _unfinished_as_stop(chunk: dict[str, Any]) -> dict[str, Any]:
    """The spec's `Completion` type requires a finish_reason, yet OpenAI (and vLLM) stream
    `"finish_reason": null` until a choice ends: that one deviation is checked here (the
    key is present and null) and the rest validated with "stop" in its place."""
    choices = []
    for choice in chunk["choices"]:
        assert "finish_reason" in choice, choice
        if choice["finish_reason"] is None:
            choice = {**choice, "finish_reason": "stop"}
        choices.append(choice)
    return {**chunk, "choices": choices}


def test_error_bodies_conform(http: httpx.Client) -> None:
    for path, body in [
        ("/v1/chat/completions", {"model": MODEL, "messages": []}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 999}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
    ]:
        response = http.post(path, json=body)
        assert response.status_code in (400, 404), response.text
        error = response.json()
        assert set(error) == {"error"}
        strict(ErrorObject, error["error"])


def test_models_and_embeddings_conform(http: httpx.Client) -> None:
    listing = http.get("/v1/models").json()
    assert listing["object"] == "list" and listing["data"]
    for card in listing["data"]:
        strict(Model, card)
    response = http.post("/v1/embeddings", json={"model": "embed-tiny", "input": ["a", "b"]})
    assert response.status_code == 200, response.text
    strict(CreateEmbeddingResponse, response.json())


def test_reasoning_content_in_message_and_deltas(harness) -> None:  # type: ignore[no-untyped-def]
    """deepseek_r1: output without </think> is all reasoning (the fake model never closes it)."""
    hello = "Hello from choice 0! The quick brown fox jumps over the lazy dog."
    with (
        harness.gateway(reasoning_parser="deepseek_r1") as gateway,
        httpx.Client(base_url=gateway.url, timeout=20) as http,
    ):
        data = _chat(http).json()
        strict(ChatCompletion, data)
        message = data["choices"][0]["message"]
        assert message["reasoning_content"] == hello and message["content"] is None
        chunks = sse_payloads(_chat(http, stream=True))
        for chunk in chunks:
            strict(ChatCompletionChunk, chunk)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == hello
        assert not "".join(d.get("content") or "" for d in deltas)
