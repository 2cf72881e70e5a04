"""logit_bias, allowed_token_ids, bad_words and the output constraint travel from the
OpenAI body to the worker's SamplingParams (the fake mesh records what it was sent)."""

from __future__ import annotations

import json

import httpx
from gateway_fakes import MODEL, Harness

PET = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _sent(http: httpx.Client, harness: Harness, path: str, body: dict):  # type: ignore[no-untyped-def]
    base = {"model": MODEL, "max_tokens": 4}
    if path.endswith("chat/completions"):
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    response = http.post(path, json={**base, **body})
    assert response.status_code == 200, response.text
    return harness.worker.last_request.sampling


def test_token_rules_reach_the_worker(http: httpx.Client, harness: Harness) -> None:
    sampling = _sent(
        http,
        harness,
        "/v1/chat/completions",
        {"logit_bias": {"5": -100, "77": 2.5}, "allowed_token_ids": [5, 77, 80], "bad_words": ["bad"]},
    )
    assert dict(sampling.logit_bias) == {5: -100.0, 77: 2.5}
    assert list(sampling.allowed_token_ids) == [5, 77, 80]
    assert list(sampling.bad_words) == ["bad"]
    assert not sampling.HasField("structured_kind")


def test_constraints_reach_the_worker(http: httpx.Client, harness: Harness) -> None:
    chat = "/v1/chat/completions"
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    cases = [
        (chat, {"response_format": schema}, "json", PET),
        (chat, {"response_format": {"type": "json_object"}}, "json_object", ""),
        (chat, {"structured_outputs": {"choice": ["a", "b"]}}, "choice", ["a", "b"]),
        ("/v1/completions", {"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ("/v1/completions", {"structured_outputs": {"grammar": 'start: "x"'}}, "grammar", 'start: "x"'),
        ("/v1/completions", {"structured_outputs": {"json": PET}}, "json", PET),
    ]
    for path, body, kind, spec in cases:
        sampling = _sent(http, harness, path, body)
        assert sampling.structured_kind == kind, body
        got = sampling.structured_spec
        assert (json.loads(got) if isinstance(spec, dict | list) else got) == spec


def test_forced_tool_choice_becomes_a_schema(http: httpx.Client, harness: Harness) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": PET}}
    named = {"type": "function", "function": {"name": "f"}}
    sampling = _sent(http, harness, "/v1/chat/completions", {"tools": [tool], "tool_choice": named})
    assert sampling.structured_kind == "json" and json.loads(sampling.structured_spec) == PET
    sampling = _sent(
        http,
        harness,
        "/v1/chat/completions",
        {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False},
    )
    schema = json.loads(sampling.structured_spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "f"}


def test_a_constraint_the_worker_refuses_names_the_clients_field(
    http: httpx.Client, harness: Harness
) -> None:
    """The worker names `structured_outputs` when it cannot build a constraint; the 400
    names the field the client used: response_format, tool_choice or structured_outputs.<kind>."""
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    tool = {"type": "function", "function": {"name": "f", "parameters": PET}}
    cases = [
        ("/v1/chat/completions", {"response_format": schema}, "response_format"),
        ("/v1/chat/completions", {"tools": [tool], "tool_choice": "required"}, "tool_choice"),
        ("/v1/completions", {"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs.regex"),
    ]
    for path, body, param in cases:
        base: dict = {"model": MODEL, "max_tokens": 4}
        if path.endswith("chat/completions"):
            base["messages"] = [{"role": "user", "content": "GRAMMAR_REFUSED"}]
        else:
            base["prompt"] = "GRAMMAR_REFUSED"
        for stream in (False, True):
            response = http.post(path, json={**base, **body, "stream": stream})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param, (path, stream, response.text)
