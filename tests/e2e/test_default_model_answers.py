"""The real default model (SmolLM2-135M-Instruct, `make model`) through the whole mesh with the official
openai client: what a new user sees first. These are the tests that fail when the model answers noise
(e.g. a random-weight model swapped in), so they assert what the answer says, not only its shape."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import anthropic
import openai
import pytest
from pydantic import BaseModel

from launcher.mesh import Mesh
from tests import head_start
from tests.mesh import running_mesh
from tests.models import default_model

# The mesh's worker compiles the default model's forward, as `make serve` does (2-3 min of a
# 2-vCPU host): a test that waits for the mesh waits up to the mesh start's own limit.
MESH_TIMEOUT_S = 600
pytestmark = pytest.mark.timeout(MESH_TIMEOUT_S)

CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Capital(BaseModel):
    country: str
    capital: str


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _answers_mesh() -> AbstractContextManager[Mesh]:
    return running_mesh(
        Path(tempfile.mkdtemp(prefix="answers-mesh-")),
        timeout=MESH_TIMEOUT_S,
        model_dir=str(default_model()),
        # Its own Redis, as `make serve` starts one.
        kv_cache_memory_mb=64,
        embedding_model_dir="",
        # The worker's defaults, which tests/conftest.py pins for every other test: the forward
        # compiled (the first request below must not pay for it) in the host's dtype (bfloat16
        # where the CPU has native bf16, as `make serve` runs it).
        extra_env=(("MESHSERVE_COMPILE_MODEL", "true"), ("MESHSERVE_DTYPE", "auto")),
    )


# The mesh starts with the session, beside the other tests (tests/head_start.py).
head_start.register("answers_mesh", _answers_mesh)


@pytest.fixture(scope="module")
def answers_mesh() -> Iterator[Mesh]:
    yield head_start.take("answers_mesh", timeout=MESH_TIMEOUT_S)
    head_start.release("answers_mesh")


@pytest.fixture(scope="module")
def client(answers_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=answers_mesh.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def model() -> str:
    return default_model().name


def test_the_first_request_after_start_gets_its_first_token_within_2_s(
    client: openai.OpenAI, model: str
) -> None:
    """First in this module: the mesh has just reported ready and served nothing yet; whatever
    the engine prepares (a compiled forward, its warm-up) must be done by then."""
    start = time.monotonic()
    stream = client.chat.completions.create(
        model=model, messages=CAPITAL_QUESTION, max_tokens=8, temperature=0, stream=True
    )
    first_token_s = None
    for chunk in stream:
        if first_token_s is None and chunk.choices and chunk.choices[0].delta.content:
            first_token_s = time.monotonic() - start
    assert first_token_s is not None and first_token_s < 2.0, first_token_s


def test_the_capital_of_france_is_paris(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=CAPITAL_QUESTION, max_tokens=24, temperature=0
    )
    choice = reply.choices[0]
    assert "Paris" in (choice.message.content or ""), choice.message.content
    assert choice.finish_reason == "stop", "the model ends its answer with <|im_end|>"


def test_json_schema_answer_parses_and_says_paris(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.parse(
        model=model, messages=CAPITAL_QUESTION, response_format=Capital, max_tokens=48, temperature=0
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Capital), reply.choices[0].message.content
    assert parsed.capital == "Paris" and parsed.country.lower() == "france", parsed


def test_forced_tool_call_has_valid_arguments_naming_the_city(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What's the weather like in Paris today?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert "Paris" in json.loads(call.function.arguments)["city"], call.function.arguments


def test_responses_and_messages_apis_say_paris(client: openai.OpenAI, answers_mesh: Mesh, model: str) -> None:
    """The agent APIs (gateway/responses_api.py, messages_api.py) on the real model."""
    response = client.responses.create(model=model, input="What is the capital of France?", temperature=0)
    assert "Paris" in response.output_text and response.status == "completed", response.output_text
    claude = anthropic.Anthropic(
        base_url=answers_mesh.gateway_url, api_key="unused", max_retries=0, timeout=120
    )
    message = claude.messages.create(
        model=model,
        max_tokens=48,
        messages=CAPITAL_QUESTION,
        extra_body={"temperature": 0},  # type: ignore[arg-type]
    )
    assert message.stop_reason == "end_turn" and "Paris" in message.content[0].text, message  # type: ignore[union-attr]
