"""Happy paths through the official openai client against the fake mesh."""

from __future__ import annotations

import base64
import json
import struct

import openai
from gateway_fakes import CACHED_TOKENS, EMBED_MODEL, MODEL, Harness

HELLO0 = "Hello from choice 0! The quick brown fox jumps over the lazy dog."


def test_chat_non_stream(client: openai.OpenAI, harness: Harness) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.5, seed=7
    )
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == HELLO0
    assert choice.finish_reason == "stop"
    assert resp.usage is not None
    prompt_len = len("<|user|>hi\n<|assistant|>")
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == len(HELLO0)
    assert resp.usage.total_tokens == prompt_len + len(HELLO0)
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS
    sent = harness.scheduler.requests[-1]
    assert sent.request_id == resp.id
    assert sent.sampling.HasField("temperature") and abs(sent.sampling.temperature - 0.5) < 1e-6
    assert sent.sampling.seed == 7
    assert not sent.sampling.HasField("top_p")  # only fields the client set
    assert sent.sampling.max_tokens == 256 - prompt_len  # default 256, capped by the context
    assert sent.tenant == "anonymous"


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == HELLO0
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_chat_max_tokens_length(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert resp.choices[0].message.content == HELLO0[:5]
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 5


def test_chat_n2_include_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    finishes = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts[0] == HELLO0
    assert texts[1] == HELLO0.replace("choice 0", "choice 1")
    assert finishes == {0: "stop", 1: "stop"}
    assert usage is not None
    assert usage.completion_tokens == 2 * len(HELLO0)
    assert usage.prompt_tokens == len("<|user|>hi\n<|assistant|>")  # not multiplied by n


def test_chat_n2_non_stream(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[1].message.content == HELLO0.replace("choice 0", "choice 1")


def test_stop_string_aborts(client: openai.OpenAI, harness: Harness) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=["quick"]
    )
    choice = resp.choices[0]
    assert choice.message.content == "Hello from choice 0! The "
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra.get("stop_reason") == "quick"
    assert resp.id in harness.scheduler.aborted
    assert resp.usage is not None
    assert resp.usage.completion_tokens == len("Hello from choice 0! The quick")
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS


def test_stop_string_stream_include(client: openai.OpenAI, harness: Harness) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stop="fox",
        stream=True,
        extra_body={"include_stop_str_in_output": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from choice 0! The quick brown fox"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[0].id in harness.scheduler.aborted


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, max_tokens=4
    )
    logprobs = resp.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [e.token for e in logprobs.content] == list("Hell")
    first = logprobs.content[0]
    assert first.logprob == -0.25
    assert first.bytes == list(b"H")
    assert [t.token for t in first.top_logprobs] == ["H", "x"]


def test_chat_logprobs_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        max_tokens=6,
        stream=True,
    )
    tokens = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                tokens.extend(e.token for e in choice.logprobs.content)
                assert all(e.top_logprobs == [] for e in choice.logprobs.content)
    assert "".join(tokens) == HELLO0[:6]


def test_tools_non_stream(client: openai.OpenAI, harness: Harness) -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "TOOL please"}], tools=tools
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    render = harness.tokenizer.last_render
    assert render is not None and json.loads(render.tools_json)[0]["function"]["name"] == "get_weather"


def test_tools_stream(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "TOOL please"}], tools=tools, stream=True
    )
    content = ""
    calls = []
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls.extend(choice.delta.tool_calls or [])
            finish = choice.finish_reason or finish
    assert content.strip() == "Let me check."
    assert "<tool_call>" not in content
    assert len(calls) == 1 and calls[0].index == 0
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments or "") == {"city": "Paris"}
    assert finish == "tool_calls"


def test_tool_choice_none_keeps_text(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "TOOL"}], tools=tools, tool_choice="none"
    )
    assert "<tool_call>" in (resp.choices[0].message.content or "")
    assert resp.choices[0].finish_reason == "stop"


def test_json_object_mode(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON"}],
        response_format={"type": "json_object"},
        n=2,
    )
    assert json.loads(resp.choices[0].message.content or "") == {"answer": 42}
    assert resp.choices[1].message.content == "not json"  # returned as is, logged + counted


def test_completions(client: openai.OpenAI, harness: Harness) -> None:
    resp = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=8)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == HELLO0[:8]
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.prompt_tokens == len("Say hi") + 1  # + BOS


def test_completions_stream_echo_and_batch(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=["A", "B"],
        max_tokens=3,
        n=2,
        echo=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "AHel", 1: "AHel", 2: "BHel", 3: "BHel"}
    assert usage is not None and usage.prompt_tokens == 4 and usage.completion_tokens == 12


def test_completions_token_prompt_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=[75, 76], max_tokens=3, logprobs=2)
    logprobs = resp.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["H", "e", "l"]
    assert logprobs.token_logprobs == [-0.25, -0.25, -0.25]
    assert logprobs.text_offset == [0, 1, 2]
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] == {"H": -0.25, "x": -2.0}


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL, EMBED_MODEL]
    assert models.data[0].model_extra is not None and models.data[0].model_extra["max_model_len"] == 256
    assert client.models.retrieve(MODEL).id == MODEL


def test_embeddings(client: openai.OpenAI) -> None:
    resp = client.embeddings.create(model=EMBED_MODEL, input=["abc", "de"])
    assert [d.index for d in resp.data] == [0, 1]
    assert len(resp.data[0].embedding) == 3
    assert abs(sum(v * v for v in resp.data[0].embedding) - 1.0) < 1e-5
    assert resp.usage.prompt_tokens == 5
    resp64 = client.embeddings.create(model=EMBED_MODEL, input="abc", encoding_format="base64")
    raw = base64.b64decode(str(resp64.data[0].embedding))
    decoded = struct.unpack("<3f", raw)
    assert all(abs(a - b) < 1e-6 for a, b in zip(decoded, resp.data[0].embedding, strict=True))


def test_completions_stream_logprobs(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, logprobs=1, stream=True)
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.tokens:
                tokens.extend(choice.logprobs.tokens)
                offsets.extend(choice.logprobs.text_offset or [])
                assert choice.logprobs.top_logprobs is not None
    assert "".join(tokens) == HELLO0[:4]
    assert offsets == [0, 1, 2, 3]
