"""The Responses and Messages APIs on the fake mesh (tests/gateway/gateway_fakes.py), for
what the random test model cannot produce: reasoning (the fake output under the
deepseek_r1 parser is all reasoning), a tool call the model chose itself (the fake's
TOOL prompt), and a gateway without Redis (the in-process response store)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from gateway_fakes import Harness, RunningGateway

from gateway import response_store
from gateway.response_store import ResponseStore, StoredResponse
from services.ports import free_port
from tests.fake_clock import FakeClock

HELLO = "Hello from choice 0! The quick brown fox jumps over the lazy dog."
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def reasoning_gateway(harness: Harness) -> Iterator[RunningGateway]:
    with harness.gateway(reasoning_parser="deepseek_r1", api_keys=("key-1", "key-2")) as gateway:
        yield gateway


def _openai(gateway: RunningGateway, key: str = "key-1") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=20)


def test_reasoning_becomes_a_reasoning_item(reasoning_gateway: RunningGateway) -> None:
    client = _openai(reasoning_gateway)
    response = client.responses.create(model="tiny", input="hi")
    [item] = response.output
    assert item.type == "reasoning" and item.content is not None
    assert item.content[0].text == HELLO and response.output_text == ""
    with client.responses.stream(model="tiny", input="hi") as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and kinds[-3:] == [
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == HELLO
    assert events[-1].response.output[0].content[0].text == HELLO  # type: ignore[union-attr]


def test_reasoning_becomes_a_thinking_block(reasoning_gateway: RunningGateway) -> None:
    client = anthropic.Anthropic(base_url=reasoning_gateway.url, api_key="key-2", max_retries=0, timeout=20)
    message = client.messages.create(
        model="tiny", max_tokens=200, messages=[{"role": "user", "content": "hi"}]
    )
    [block] = message.content
    assert block.type == "thinking" and block.thinking == HELLO
    assert message.stop_reason == "end_turn"
    with client.messages.stream(
        model="tiny", max_tokens=200, messages=[{"role": "user", "content": "hi"}]
    ) as s:
        thinking = "".join(e.thinking for e in s if e.type == "thinking")
        final = s.get_final_message()
    assert thinking == HELLO and final.content[0].type == "thinking"


def test_a_parsed_tool_call_becomes_a_function_call_item(gw: RunningGateway) -> None:
    client = _openai(gw)
    response = client.responses.create(model="tiny", input="TOOL please", tools=[TOOL])  # type: ignore[list-item]
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Let me check."
    call = response.output[1]
    assert (
        call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"city": "Paris"}'
    )
    with client.responses.stream(model="tiny", input="TOOL please", tools=[TOOL]) as stream:  # type: ignore[list-item]
        args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert args == '{"city": "Paris"}'
    assert [item.type for item in final.output] == ["message", "function_call"]


def test_a_parsed_tool_call_becomes_a_tool_use_block(gw: RunningGateway) -> None:
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=20)
    tool: Any = {"name": "get_weather", "input_schema": {"type": "object"}}
    message = client.messages.create(
        model="tiny", max_tokens=200, messages=[{"role": "user", "content": "TOOL please"}], tools=[tool]
    )
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert message.stop_reason == "tool_use"
    with client.messages.stream(
        model="tiny", max_tokens=200, messages=[{"role": "user", "content": "TOOL please"}], tools=[tool]
    ) as stream:
        final = stream.get_final_message()
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"  # type: ignore[union-attr]


def test_without_redis_responses_are_kept_locally_and_not_continued(
    reasoning_gateway: RunningGateway,
) -> None:
    client = _openai(reasoning_gateway)
    created = client.responses.create(model="tiny", input="hi")
    assert client.responses.retrieve(created.id).id == created.id
    with pytest.raises(openai.NotFoundError):
        _openai(reasoning_gateway, "key-2").responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="tiny", input="more", previous_response_id=created.id)
    assert raised.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert "redis" in raised.value.message


async def test_the_local_store_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(response_store, "LOCAL_CAPACITY", 3)
    store = ResponseStore("", ttl_s=60)
    for i in range(5):
        await store.put("owner", StoredResponse(response={"id": f"resp_{i}", "output": []}, items=[]))
    assert [await store.get("owner", f"resp_{i}") is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert await store.get("other", "resp_4") is None


async def test_the_local_store_expires_records_after_the_ttl() -> None:
    clock = FakeClock()
    store = ResponseStore("", ttl_s=60, clock=clock)
    await store.put("owner", StoredResponse(response={"id": "resp_1", "output": []}, items=[]))
    clock.advance(60)
    assert await store.get("owner", "resp_1") is not None  # exactly the TTL: still kept
    clock.advance(0.001)
    assert await store.get("owner", "resp_1") is None
    assert not await store.delete("owner", "resp_1")  # the expired record is gone, not hidden


def test_an_unreachable_redis_is_a_503_not_a_silent_loss(harness: Harness) -> None:
    """Redis configured but down (nothing listens on its port): a stored create, a
    previous_response_id and a GET answer 503 store_unavailable; store=false still works."""
    with harness.gateway(redis_url=f"redis://127.0.0.1:{free_port()}/0") as gateway:
        client = _openai(gateway)
        assert client.responses.create(model="tiny", input="hi", store=False).output_text == HELLO
        for call in (
            lambda: client.responses.create(model="tiny", input="hi"),
            lambda: client.responses.create(model="tiny", input="hi", previous_response_id="resp_1"),
            lambda: client.responses.retrieve("resp_1"),
        ):
            with pytest.raises(openai.InternalServerError) as raised:
                call()
            assert raised.value.status_code == 503
            assert raised.value.body["code"] == "store_unavailable"  # type: ignore[index]
