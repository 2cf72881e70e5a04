"""Tool-call parsers (Hermes/Qwen, Llama 3 JSON, Mistral) and the `<think>` reasoning
parser on fixed outputs, whole and streamed in every split (one character per delta,
and a few chunkings): the same calls and text either way, nothing dropped."""

from __future__ import annotations

import json
import random

import pytest

from gateway import reasoning
from gateway.config import GatewayConfig
from gateway.protocol import ChatCompletionRequest
from gateway.tool_parsers import PARSERS, ToolCallDelta, ToolParser, parse_whole, parser_name_for
from gateway.tools import forced_tool_calls, forced_tool_parser

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


def _splits(text: str) -> list[list[str]]:
    """The text cut every way the tests try: fixed sizes, every single cut, and seeded
    random cuts into many pieces."""
    sizes = [[text[i : i + size] for i in range(0, len(text), size)] for size in (1, 3, 7, 10_000)]
    cuts = [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(len(text))
    randoms = []
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        randoms.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return sizes + cuts + randoms


def _stream(name: str, pieces: list[str]) -> tuple[str, list[ToolCallDelta], ToolParser]:
    parser = PARSERS[name]()
    content, deltas = "", list[ToolCallDelta]()
    for piece in pieces:
        c, more = parser.feed(piece)
        content, deltas = content + c, deltas + more
    tail, more = parser.finish()
    return content + tail, deltas + more, parser


def _assemble(deltas: list[ToolCallDelta]) -> dict[int, dict[str, str]]:
    """What a client builds from the deltas (as the openai SDK does), checking their
    order: each call's header (id, name, arguments "") first, then only fragments."""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        if delta.id is not None:
            assert delta.index not in calls and delta.name and delta.arguments == ""
            assert delta.index == len(calls)  # indexes count up from 0
            calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": ""}
        else:
            assert delta.name is None and delta.index in calls and delta.arguments
            calls[delta.index]["arguments"] += delta.arguments
    return calls


def _canonical(arguments: str) -> str:
    """The arguments text every streamed and non-streamed call gives (json_stream)."""
    return json.dumps(json.loads(arguments), ensure_ascii=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_calls_whole_and_streamed(case: str) -> None:
    """Every split gives the same calls as the whole output: same names, and argument
    fragments that concatenate to exactly the non-streamed arguments text, which is
    json.dumps of the arguments (ensure_ascii=False)."""
    name = case.split("_v")[0]
    text, expected_content = CASES[case]
    whole_content, whole_calls = parse_whole(PARSERS[name](), text)
    assert whole_content == expected_content
    assert [c.function.name for c in whole_calls] == ["get_weather", "get_time"]
    assert whole_calls[0].function.arguments == json.dumps(WEATHER["arguments"], ensure_ascii=False)
    assert whole_calls[1].function.arguments == "{}"
    assert len({c.id for c in whole_calls}) == 2
    for pieces in _splits(text):
        content, deltas, parser = _stream(name, pieces)
        assert (content.strip() or None) == expected_content, pieces
        streamed = _assemble(deltas)
        assert [(c.id, c.function.name, c.function.arguments) for c in parser.calls] == [
            (s["id"], s["name"], s["arguments"]) for s in streamed.values()
        ], pieces
        assert [(c.function.name, c.function.arguments) for c in parser.calls] == [
            (c.function.name, c.function.arguments) for c in whole_calls
        ], pieces


ODD = {
    # escapes, numbers, nesting, irregular whitespace, arguments before the name
    "hermes": '<tool_call> { "arguments" : {"q": "\\u00e9\\n\\"x\\" \\ud83d\\ude00 \\/", '
    '"n": [1.50e1, -0, 10E-1, true, null, {"k": [ ]}], "e": {}},"name":"search" }\n</tool_call>',
    "llama3_json": '{"name":"search","parameters":{"q":"\\u00e9\\n","n":[1.50e1,-0],"e":{}}}',
    "mistral": '[TOOL_CALLS]search[ARGS]{ "q" : "\\t\\u00e9" , "n" : [ 1.50e1 , false ] }</s>',
    # arguments given as a JSON string are passed on as that string
    "hermes_str": '<tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}</tool_call>',
}


@pytest.mark.parametrize("case", sorted(ODD))
def test_arguments_are_canonical_json_in_every_split(case: str) -> None:
    name = case.split("_")[0] if case != "llama3_json" else case
    text = ODD[case]
    _, whole_calls = parse_whole(PARSERS[name](), text)
    assert [c.function.name for c in whole_calls] == ["search"]
    arguments = whole_calls[0].function.arguments
    if case == "hermes_str":
        assert arguments == '{"q": 1}'
    else:
        assert arguments == _canonical(arguments) and "  " not in arguments
    for pieces in _splits(text):
        _, deltas, parser = _stream(name, pieces)
        streamed = _assemble(deltas)
        assert [s["arguments"] for s in streamed.values()] == [arguments], pieces
        assert len(parser.calls) == 1


def test_odd_arguments_decode_to_the_model_values() -> None:
    _, calls = parse_whole(PARSERS["hermes"](), ODD["hermes"])
    assert json.loads(calls[0].function.arguments) == {
        "q": 'é\n"x" \U0001f600 /',
        "n": [15.0, 0, 1.0, True, None, {"k": []}],
        "e": {},
    }


LONG = {"city": "Paris", "notes": "x" * 200, "days": list(range(30))}
LONG_CASES = {
    "hermes": f'<tool_call>{{"name": "plan", "arguments": {json.dumps(LONG)}}}</tool_call>',
    "llama3_json": f'{{"name": "plan", "parameters": {json.dumps(LONG)}}}',
    "mistral": f"[TOOL_CALLS]plan[ARGS]{json.dumps(LONG)}",
    "mistral_v3": f'[TOOL_CALLS][{{"name": "plan", "arguments": {json.dumps(LONG)}}}]',
}


@pytest.mark.parametrize("case", sorted(LONG_CASES))
def test_long_arguments_stream_in_fragments_after_an_early_header(case: str) -> None:
    """The header goes out as soon as the name is known, long before the arguments end;
    the arguments then come in many fragments, one or more per delta fed."""
    name = case.split("_v")[0]
    text = LONG_CASES[case]
    parser = PARSERS[name]()
    header_at, fragments = None, []
    for i in range(0, len(text), 16):
        _, deltas = parser.feed(text[i : i + 16])
        for delta in deltas:
            if delta.id is not None:
                header_at = i
            else:
                fragments.append(delta.arguments)
    _, deltas = parser.finish()
    fragments += [d.arguments for d in deltas]
    assert header_at is not None and header_at < text.index("Paris")
    assert len(fragments) > 10
    assert "".join(fragments) == json.dumps(LONG, ensure_ascii=False) == parser.calls[0].function.arguments


BROKEN = {
    # JSON that breaks after the name is known: the header went out, the call never completes
    "hermes": 'A <tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call> B',
    "llama3_json": '{"name": "f", "parameters": {"a": [1, }',
    "mistral": 'A[TOOL_CALLS][{"name": "f", "arguments": {"a": 1 2}}]',
    # not a call at all
    "hermes_noname": '<tool_call>{"arguments": {}}</tool_call>',
    "mistral_v11": "A[TOOL_CALLS]not a name{",
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_invalid_call_is_content_in_every_split(case: str) -> None:
    name = case.split("_v")[0].split("_no")[0]
    text = BROKEN[case]
    assert parse_whole(PARSERS[name](), text) == (text, [])
    for pieces in _splits(text):
        content, deltas, parser = _stream(name, pieces)
        assert content == text and parser.calls == [], pieces
        for call in _assemble(deltas).values():  # a header may have gone out: never completed
            with pytest.raises(json.JSONDecodeError):
                json.loads(call["arguments"])


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", 'ok <tool_call>{"name": "f", "arguments": {"city": "Par'),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"city": "Paris", '),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"city": "Paris", "n": 12'),
    ],
)
def test_call_cut_by_max_tokens_is_content_never_completed(name: str, text: str) -> None:
    """Output cut mid-call (max_tokens): the text is content, the call is not in
    `calls`, and its fragments never form complete JSON (no closing is invented)."""
    assert parse_whole(PARSERS[name](), text) == (text, [])
    for pieces in _splits(text):
        content, deltas, parser = _stream(name, pieces)
        assert content == text and parser.calls == []
        streamed = _assemble(deltas)
        assert [s["name"] for s in streamed.values()] == ["f"]  # the header went out early
        assert '"city": "Par' in streamed[0]["arguments"]
        with pytest.raises(json.JSONDecodeError):
            json.loads(streamed[0]["arguments"])


def test_calls_before_a_broken_one_stay_calls() -> None:
    text = '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": 7}]'
    for pieces in _splits(text):
        content, _, parser = _stream("mistral", pieces)
        assert [c.function.name for c in parser.calls] == ["a"]
        assert content == ', {"name": "b", "arguments": 7}]'  # all since the last call


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_text_without_calls_is_content(name: str) -> None:
    for text in ["Just an answer, no tools.", "{not json at all", "[TOOL_CALLS] broken [", "<tool_call>{bad"]:
        content, _, parser = _stream(name, [text[i : i + 2] for i in range(0, len(text), 2)])
        assert parser.calls == [] and content == text, (name, text)


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


@pytest.mark.parametrize(
    ("choice", "text", "names"),
    [
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '{"city": "Paris", "days": [1, 2]}',
            ["get_weather"],
        ),
        (
            "required",
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "t", "parameters": {}}]',
            ["get_weather", "t"],
        ),
    ],
)
def test_forced_tool_choice_streams_like_the_parsers(choice: object, text: str, names: list[str]) -> None:
    """tool_choice named / "required" (output constrained to the calls' JSON): streamed
    incrementally too (a named call's header before any output), same calls as whole."""
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice}
    )
    content, calls = forced_tool_calls(body, text)
    assert content is None and [c.function.name for c in calls] == names
    assert all(c.function.arguments == _canonical(c.function.arguments) for c in calls)
    for pieces in _splits(text):
        parser = forced_tool_parser(body)
        first, early = parser.feed(pieces[0])
        if choice != "required":
            assert early and early[0].name == "get_weather"  # the header at once
        streamed, deltas = "", list(early)
        for piece in pieces[1:]:
            c, more = parser.feed(piece)
            streamed, deltas = streamed + c, deltas + more
        tail, more = parser.finish()
        assert (first + streamed + tail).strip() == ""
        assert [(s["name"], s["arguments"]) for s in _assemble(deltas + more).values()] == [
            (c.function.name, c.function.arguments) for c in calls
        ]
    cut = text[: len(text) // 2]
    assert forced_tool_calls(body, cut) == (cut, [])
