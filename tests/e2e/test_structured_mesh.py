"""Structured outputs end to end: a real mesh (every service a process, real Redis, the
tiny real model) and the official client's `parse()` with pydantic models. The model's
weights are random-ish, so only the constraint makes its output parse."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.mesh import RunningMesh

MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
Short = Annotated[str, Field(max_length=8)]


class Kind(StrEnum):
    cat = "cat"
    dog = "dog"


class Owner(BaseModel):
    name: Short
    vip: bool


class Pet(BaseModel):
    kind: Kind
    name: Short
    tags: Annotated[list[Annotated[str, Field(max_length=4)]], Field(max_length=2)]
    owner: Owner


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client(e2e_mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=e2e_mesh.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI, model_dir: Path) -> str:
    return model_dir.name


def test_parse_nested_enum_array_n2(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Pet, n=2, temperature=1.0, seed=4, max_tokens=150
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet), choice.message.content


def test_streamed_constrained_output_parses(client: openai.OpenAI, model: str) -> None:
    text = []
    with client.chat.completions.stream(
        model=model, messages=MESSAGES, response_format=Pet, temperature=0.8, max_tokens=150
    ) as stream:
        for event in stream:
            if event.type == "content.delta":
                text.append(event.delta)
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Pet)
    Pet.model_validate_json("".join(text))


def test_mixed_batch_constrained_and_not(client: openai.OpenAI, model: str) -> None:
    def constrained(seed: int) -> Pet | None:
        reply = client.chat.completions.parse(
            model=model, messages=MESSAGES, response_format=Pet, temperature=1.0, seed=seed, max_tokens=150
        )
        return reply.choices[0].message.parsed

    def plain(seed: int) -> str | None:
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=40
        )
        return reply.choices[0].message.content

    # All eight in flight at once (submitted together, interleaved): the worker batches
    # constrained and unconstrained rows in the same steps.
    with ThreadPoolExecutor(8) as pool:
        pet_futures = [pool.submit(constrained, seed) for seed in range(4)]
        text_futures = [pool.submit(plain, seed) for seed in range(4)]
        pets = [f.result() for f in pet_futures]
        texts = [f.result() for f in text_futures]
    assert all(isinstance(p, Pet) for p in pets)
    assert all(texts)


def test_extras_choice_regex(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=20,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )
    assert reply.choices[0].message.content in ("alpha", "beta")
    # [0-9], not \d: llguidance's \d is any Unicode decimal digit (a random model once
    # sampled U+10D48, a digit Python's Unicode tables predate).
    code = r"[A-Z]{2}-[0-9]{3}"
    done = client.completions.create(
        model=model,
        prompt="Code:",
        max_tokens=20,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": code}},
    )
    text = done.choices[0].text
    assert re.fullmatch(code, text), text


def test_json_object_and_grammar_through_the_mesh(client: openai.OpenAI, model: str) -> None:
    """response_format json_object (chat) and a Lark grammar (completions) hold through the
    whole mesh on a random model: the output parses as an object / matches the grammar."""
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=60,
        temperature=1.0,
        seed=7,
        response_format={"type": "json_object"},
    )
    content = reply.choices[0].message.content or ""
    # A random model may run out of tokens inside a string: then the text so far must
    # still be the start of an object; when it stops, the whole text is one.
    assert content.lstrip().startswith("{"), content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict), content
    done = client.completions.create(
        model=model,
        prompt="Sum:",
        max_tokens=20,
        temperature=1.0,
        seed=7,
        extra_body={"structured_outputs": {"grammar": 'start: "x" ("+" "x")~2..3'}},
    )
    text = done.choices[0].text
    assert text in ("x+x+x", "x+x+x+x"), text


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choice_always_parses(client: openai.OpenAI, model: str, tool_choice: object) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice=tool_choice,  # type: ignore[arg-type]
        temperature=1.0,
        seed=2,
        max_tokens=120,
        parallel_tool_calls=False,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and all(c.function.name == "get_weather" for c in calls)
    for call in calls:
        assert set(json.loads(call.function.arguments)) == {"city"}


def test_bad_schema_is_400_and_the_mesh_goes_on(
    e2e_mesh: RunningMesh, client: openai.OpenAI, model: str
) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    response = httpx.post(
        e2e_mesh.gateway_url + "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "response_format": bad},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"
    reply = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Pet, max_tokens=150)
    assert isinstance(reply.choices[0].message.parsed, Pet)


def test_forced_tool_call_streamed(client: openai.OpenAI, model: str) -> None:
    """The SDK's stream helper assembles the streamed call (header at once, then the
    arguments in fragments as they are generated)."""
    fragments = []
    with client.chat.completions.stream(
        model=model,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=5,
        max_tokens=120,
    ) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city"}
    assert "".join(fragments) == calls[0].function.arguments
