"""Tool-call parsers (Hermes/Qwen, Llama 3 JSON, Mistral) and the `<think>` reasoning
parser on fixed outputs, whole and streamed in every split (one character per delta,
and a few chunkings): the same calls and text either way, nothing dropped."""

from __future__ import annotations

import json

import pytest

from gateway import reasoning
from gateway.config import GatewayConfig
from gateway.tool_parsers import PARSERS, parse_whole, parser_name_for

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}
CASES = {
    "hermes": (
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}</tool_call>'
        '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "Let me check.",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}; '
        '{"name": "get_time", "parameters": {}}<|eot_id|>',
        None,
    ),
    "mistral": (
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, '
        '{"name": "get_time", "arguments": {}}]</s>',
        "Sure.",
    ),
    "mistral_v11": (
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}[TOOL_CALLS]get_time[ARGS]{}',
        "Sure.",
    ),
}


def _stream(name: str, text: str, size: int) -> tuple[str, list]:
    parser = PARSERS[name]()
    content, calls = "", []
    for i in range(0, len(text), size):
        c, more = parser.feed(text[i : i + size])
        content, calls = content + c, calls + more
    tail, more = parser.finish()
    return content + tail, calls + more


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("size", [1, 3, 7, 10_000])
def test_calls_whole_and_streamed(case: str, size: int) -> None:
    name = case.split("_v")[0]
    text, expected_content = CASES[case]
    content, calls = _stream(name, text, size)
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == WEATHER["arguments"]
    assert json.loads(calls[1].function.arguments) == {}
    assert len({c.id for c in calls}) == 2
    assert (content.strip() or None) == expected_content
    whole_content, whole_calls = parse_whole(PARSERS[name](), text)
    assert whole_content == expected_content and len(whole_calls) == 2


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_text_without_calls_is_content(name: str) -> None:
    for text in ["Just an answer, no tools.", "{not json at all", "[TOOL_CALLS] broken [", "<tool_call>{bad"]:
        content, calls = _stream(name, text, 2)
        assert calls == [] and content == text, (name, text)


def test_mistral_content_streams_before_the_marker() -> None:
    parser = PARSERS["mistral"]()
    assert parser.feed("Hello [TOOL") == ("Hello ", [])  # the marker's start is held
    assert parser.feed("_CALLS][") == ("", [])


def test_parser_selection_per_model() -> None:
    spec = "llama=llama3_json,mistral-7b=mistral,hermes"
    assert parser_name_for(spec, "llama") == "llama3_json"
    assert parser_name_for(spec, "mistral-7b") == "mistral"
    assert parser_name_for(spec, "other") == "hermes"
    assert parser_name_for("", "x") == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        GatewayConfig(tool_call_parser="m=nope")
    with pytest.raises(ValueError, match="reasoning_parser"):
        GatewayConfig(reasoning_parser="o1")


REASONING = [
    ("qwen3", "<think>\nweigh options</think>\n\nThe answer.", "\nweigh options", "The answer."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<thin", None, "<thin"),
    ("deepseek_r1", "weigh options</think>The answer.", "weigh options", "The answer."),
    ("deepseek_r1", "<think>weigh</think>The answer.", "weigh", "The answer."),
    ("deepseek_r1", "still thinking </thi", "still thinking </thi", None),
]


@pytest.mark.parametrize(("name", "text", "thoughts", "content"), REASONING)
@pytest.mark.parametrize("size", [1, 4, 10_000])
def test_reasoning_split(name: str, text: str, thoughts: str | None, content: str | None, size: int) -> None:
    assert reasoning.split(name, text) == (thoughts, content)
    parser = reasoning.ReasoningParser(name)
    got_t, got_c = "", ""
    for i in range(0, len(text), size):
        t, c = parser.feed(text[i : i + size])
        got_t, got_c = got_t + t, got_c + c
    t, c = parser.finish()
    assert (got_t + t or None, got_c + c or None) == (thoughts, content)
