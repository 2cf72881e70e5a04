"""The Responses API and Anthropic's Messages API end to end: real processes for every
service, two gateway processes sharing one real redis-server, the random test model,
and the official `openai` and `anthropic` clients.

Both APIs run on the chat path, so their greedy output must be the greedy output of the
same conversation through /v1/chat/completions (same rendering, same tokens): that is
what the content assertions compare against."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from launcher.mesh import Mesh
from services.ports import free_port
from services.redis_client import RedisServer
from tests.mesh import running_mesh, wait_gateway_healthy

KEY_A, KEY_B = "agent-key-a", "agent-key-b"
GREEDY = {"temperature": 0}  # the anthropic SDK has no sampling arguments: sent as extra body
STORE_PATTERN = "meshserve:responses:*"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": WEATHER_SCHEMA,
}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in RESPONSES_TOOL.items() if k != "type"}}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}


class Answer(BaseModel):
    city: str = Field(max_length=10)
    days: int


@pytest.fixture(scope="module")
def agent_mesh(
    model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    with running_mesh(
        tmp_path_factory.mktemp("mesh"),
        timeout=240,
        model_dir=str(model_dir),
        redis_url=redis_server.url,
        kv_cache_memory_mb=64,
        embedding_model_dir="",
        api_keys=f"{KEY_A},{KEY_B}",
    ) as started:
        # A second gateway beside the mesh's own, on the same scheduler and keys.
        spec = started.specs["gateway"]
        port = free_port()
        env = {**spec.env, "MESHSERVE_PORT": str(port)}
        started.add_service(dataclasses.replace(spec, name="gateway-2", port=port, env=env))
        wait_gateway_healthy(f"http://127.0.0.1:{port}")
        yield started


def _url(agent_mesh: Mesh, gateway: str) -> str:
    return f"http://127.0.0.1:{agent_mesh.specs[gateway].port}"


@pytest.fixture(scope="module")
def oai(agent_mesh: Mesh) -> openai.OpenAI:
    """Key A on the first gateway."""
    return openai.OpenAI(
        base_url=_url(agent_mesh, "gateway") + "/v1", api_key=KEY_A, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def oai_2(agent_mesh: Mesh) -> openai.OpenAI:
    """Key A on the second gateway."""
    return openai.OpenAI(
        base_url=_url(agent_mesh, "gateway-2") + "/v1", api_key=KEY_A, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def oai_b(agent_mesh: Mesh) -> openai.OpenAI:
    """Key B on the second gateway."""
    return openai.OpenAI(
        base_url=_url(agent_mesh, "gateway-2") + "/v1", api_key=KEY_B, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def claude(agent_mesh: Mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=_url(agent_mesh, "gateway"), api_key=KEY_A, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def store(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def model(model_dir: Path) -> str:
    return model_dir.name


def _chat(
    client: openai.OpenAI, model: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any
) -> Any:
    """The greedy chat completion the other APIs must reproduce."""
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        **extra,  # type: ignore[arg-type]
    )


def _stored(store: redis.Redis) -> set[bytes]:
    return set(store.scan_iter(STORE_PATTERN))


# ----------------------------------------------------------------------- Responses


def test_responses_create_equals_chat_and_is_stored(
    oai: openai.OpenAI, model: str, store: redis.Redis
) -> None:
    chat = _chat(
        oai, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}], 10
    )
    response = oai.responses.create(
        model=model, instructions="Be brief.", input="Hi there", max_output_tokens=10, temperature=0
    )
    assert response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    expected_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected_status
    assert response.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    keys = [k for k in _stored(store) if k.endswith(response.id.encode())]
    assert len(keys) == 1
    assert KEY_A.encode() not in keys[0] and 0 < store.ttl(keys[0])
    record = json.loads(store.get(keys[0]) or b"{}")
    assert record["response"]["output"][0]["content"][0]["text"] == response.output_text
    assert record["items"] == [{"type": "message", "role": "user", "content": "Hi there"}]


def test_responses_stream_event_sequence(oai: openai.OpenAI, model: str) -> None:
    chat = _chat(oai, model, [{"role": "user", "content": "Tell me a story"}], 12)
    with oai.responses.stream(
        model=model, input="Tell me a story", max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == chat.choices[0].message.content
    final_kind = "response.incomplete" if chat.choices[0].finish_reason == "length" else "response.completed"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final_kind,
    ]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == chat.choices[0].message.content
    assert final.usage is not None and final.usage.output_tokens == chat.usage.completion_tokens
    assert final.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_parse_follows_the_schema(oai: openai.OpenAI, model: str) -> None:
    schema = {"name": "Answer", "schema": to_strict_json_schema(Answer), "strict": True}
    messages = [{"role": "user", "content": "Weather?"}]
    chat = _chat(oai, model, messages, 60, response_format={"type": "json_schema", "json_schema": schema})
    parsed = oai.responses.parse(
        model=model, input="Weather?", text_format=Answer, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, Answer)
    assert parsed.output_text == chat.choices[0].message.content
    with oai.responses.stream(
        model=model, input="Weather?", text_format=Answer, max_output_tokens=60, temperature=0
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_parsed == parsed.output_parsed


def test_function_call_round_trip_across_gateways(
    oai: openai.OpenAI, oai_2: openai.OpenAI, model: str
) -> None:
    first = oai.responses.create(
        model=model,
        input="Weather in Paris?",
        tools=[RESPONSES_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and first.status == "completed"
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"city"}
    # The call's answer on the other gateway process: the conversation comes from Redis.
    second = oai_2.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        max_output_tokens=10,
        temperature=0,
    )
    tool_call = {
        "id": calls[0].call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": calls[0].arguments},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"},
    ]
    chat = _chat(oai, model, messages, 10)
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens == chat.usage.prompt_tokens


def test_function_call_streams_its_arguments(oai: openai.OpenAI, model: str) -> None:
    with oai.responses.stream(
        model=model,
        input="Weather in Oslo?",
        tools=[RESPONSES_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = final.output
    assert call.type == "function_call" and call.arguments == arguments and json.loads(arguments)


def test_get_and_delete_are_per_key(
    oai: openai.OpenAI, oai_2: openai.OpenAI, oai_b: openai.OpenAI, model: str, store: redis.Redis
) -> None:
    created = oai.responses.create(model=model, input="Remember me", max_output_tokens=4, temperature=0)
    fetched = oai_2.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    with pytest.raises(openai.NotFoundError):
        oai_b.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        oai_b.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        oai_b.responses.create(
            model=model, previous_response_id=created.id, input="and?", max_output_tokens=2
        )
    oai_2.responses.delete(created.id)
    assert not [k for k in _stored(store) if k.endswith(created.id.encode())]
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(created.id)


def test_store_false_keeps_nothing(oai: openai.OpenAI, model: str, store: redis.Redis) -> None:
    before = _stored(store)
    response = oai.responses.create(model=model, input="Forget me", max_output_tokens=3, store=False)
    assert response.store is False
    assert _stored(store) == before
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"previous_response_id": "resp_unknown", "input": "hi"}, 404, "previous_response_id"),
        ({"input": [{"type": "bogus"}]}, 400, "input[0].type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            400,
            "input[0].call_id",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input[0].content[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ],
)
def test_responses_bad_input_names_the_field_and_stores_nothing(
    oai: openai.OpenAI, model: str, store: redis.Redis, kwargs: dict[str, Any], status: int, param: str
) -> None:
    before = _stored(store)
    with pytest.raises(openai.APIStatusError) as raised:
        oai.responses.create(model=model, **kwargs)
    assert raised.value.status_code == status
    body = raised.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert _stored(store) == before


# ------------------------------------------------------------------------ Messages


def test_messages_create_equals_chat(claude: anthropic.Anthropic, oai: openai.OpenAI, model: str) -> None:
    chat = _chat(
        oai, model, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"}], 10
    )
    message = claude.messages.create(
        model=model,
        system="Be kind.",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=10,
        extra_body={"top_k": 1},  # greedy another way: the SDK no longer sends sampling fields
        metadata={"user_id": "u1"},
    )
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    count = claude.messages.count_tokens(
        model=model, system="Be kind.", messages=[{"role": "user", "content": "Hello"}]
    )
    assert count.input_tokens == chat.usage.prompt_tokens


def test_messages_stop_sequence(claude: anthropic.Anthropic, model: str) -> None:
    full = claude.messages.create(
        model=model, messages=[{"role": "user", "content": "Count"}], max_tokens=16, extra_body=GREEDY
    )
    text = full.content[0].text  # type: ignore[union-attr]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    cut = claude.messages.create(
        model=model,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=16,
        stop_sequences=[stop],
        extra_body=GREEDY,
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_messages_stream_event_sequence(
    claude: anthropic.Anthropic, oai: openai.OpenAI, agent_mesh: Mesh, model: str
) -> None:
    chat = _chat(oai, model, [{"role": "user", "content": "Sing"}], 12)
    request: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Sing"}],
        "max_tokens": 12,
    }
    with claude.messages.stream(**request, extra_body=GREEDY) as stream:
        events = [e for e in stream if e.type not in ("text", "input_json", "thinking")]
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "content_block_delta"]
    expected = [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * len(deltas),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert kinds == [k for k in expected if k != "ping"]  # the SDK drops pings: read them raw
    headers = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST",
        _url(agent_mesh, "gateway") + "/v1/messages",
        json={**request, **GREEDY, "stream": True},
        headers=headers,
        timeout=120,
    ) as raw:
        names = [line.removeprefix("event: ") for line in raw.iter_lines() if line.startswith("event: ")]
    assert names == expected
    assert "".join(d.delta.text for d in deltas) == chat.choices[0].message.content  # type: ignore[union-attr]
    assert final.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    assert final.usage.output_tokens == chat.usage.completion_tokens
    assert final.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")


def test_messages_tool_round_trip(claude: anthropic.Anthropic, oai: openai.OpenAI, model: str) -> None:
    question = {"role": "user", "content": "Weather in Rome?"}
    with claude.messages.stream(
        model=model,
        messages=[question],  # type: ignore[list-item]
        tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=40,
        extra_body=GREEDY,
    ) as stream:
        kinds = [e.type for e in stream]
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use" and kinds[0] == "message_start" and kinds[-1] == "message_stop"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}  # type: ignore[arg-type]
    answer = claude.messages.create(
        model=model,
        messages=[
            question,  # type: ignore[list-item]
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
        ],
        tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "none"},
        max_tokens=10,
        extra_body=GREEDY,
    )
    tool_call = {
        "id": use.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(use.input)},
    }
    messages = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"},
    ]
    chat = _chat(oai, model, messages, 10, tools=[CHAT_TOOL], tool_choice="none")
    assert answer.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}
                ],
            },
            "messages.0.content.0.tool_use_id",
        ),
        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]},
            "stop_sequences[0]",
        ),
    ],
)
def test_messages_bad_input_in_anthropic_shape(
    claude: anthropic.Anthropic, model: str, body: dict[str, Any], field: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.post("/v1/messages", body={"model": model, **body}, cast_to=object)
    error = raised.value.body
    assert isinstance(error, dict) and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(field), error


def test_x_api_key_is_checked(agent_mesh: Mesh, model: str) -> None:
    wrong = anthropic.Anthropic(
        base_url=_url(agent_mesh, "gateway"), api_key="wrong", max_retries=0, timeout=60
    )
    with pytest.raises(anthropic.AuthenticationError) as raised:
        wrong.messages.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
