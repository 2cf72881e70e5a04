"""Happy paths through the official openai client against the fake mesh."""

from __future__ import annotations

import base64
import json
import struct
import time

import httpx
import openai
from gateway_fakes import (
    CACHED_TOKENS,
    EMBED_MODEL,
    MODEL,
    UNICODE_TEXT,
    Harness,
    encode,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families

from meshserve.v1 import common_pb2
from tests.fake_clock import FakeClock

HELLO0 = "Hello from choice 0! The quick brown fox jumps over the lazy dog."
# The ENDLESS script: HELLO0, then a slow tail that only an abort (or max_tokens) ends.
ENDLESS = [{"role": "user", "content": "ENDLESS hi"}]


def assert_released(harness: Harness, request_id: str) -> None:
    """Every lease issued for `request_id` went back to the scheduler (Release)."""
    leases = harness.scheduler.leases_of(request_id)
    assert leases, f"no lease was issued for {request_id}"
    assert wait_for(lambda: set(leases) <= set(harness.scheduler.released)), (
        f"leases {leases} not released; released: {harness.scheduler.released[-5:]}"
    )


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
    # What the worker ran: the request as routed, under the lease the scheduler issued.
    sent = harness.worker.last_request
    assert sent.request_id == resp.id
    assert sent.sampling.HasField("temperature") and abs(sent.sampling.temperature - 0.5) < 1e-6
    assert sent.sampling.seed == 7
    assert not sent.sampling.HasField("top_p")  # only fields the client set
    assert sent.sampling.max_tokens == 256 - prompt_len  # default 256, capped by the context
    assert sent.tenant == "anonymous"
    assert list(sent.prompt_token_ids) == encode("<|user|>hi\n<|assistant|>")
    routes = harness.scheduler.routes_of(resp.id)
    assert len(routes) == 1 and list(routes[0].exclude_worker_ids) == []
    assert routes[0].request.sampling == sent.sampling
    assert [sent.lease_id] == harness.scheduler.leases_of(resp.id)
    assert resp.id in harness.worker.completed and resp.id not in harness.worker.aborted
    assert_released(harness, resp.id)


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
    """A stop string ends the choice in the gateway, which aborts the request on the
    worker stream (the worker would generate on for seconds otherwise); the worker's
    final message still brings usage."""
    resp = client.chat.completions.create(model=MODEL, messages=ENDLESS, stop=["quick"])
    choice = resp.choices[0]
    assert choice.message.content == "Hello from choice 0! The "
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra.get("stop_reason") == "quick"
    assert harness.worker.aborts.count(resp.id) == 1
    assert resp.id in harness.worker.cancelled and resp.id not in harness.worker.completed
    assert resp.usage is not None
    assert resp.usage.completion_tokens == len("Hello from choice 0! The quick")
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS
    assert_released(harness, resp.id)


def test_stop_string_stream_include(client: openai.OpenAI, harness: Harness) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ENDLESS,
        stop="fox",
        stream=True,
        extra_body={"include_stop_str_in_output": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from choice 0! The quick brown fox"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert harness.worker.aborts.count(chunks[0].id) == 1
    assert_released(harness, chunks[0].id)


def test_stop_strings_on_every_choice_abort_once(client: openai.OpenAI, harness: Harness) -> None:
    """n=2: the request is aborted once both choices met a stop string, not before."""
    resp = client.chat.completions.create(model=MODEL, messages=ENDLESS, n=2, stop=["brown", "choice 1"])
    assert [c.message.content for c in resp.choices] == ["Hello from choice 0! The quick ", "Hello from "]
    assert [c.finish_reason for c in resp.choices] == ["stop", "stop"]
    assert harness.worker.aborts.count(resp.id) == 1
    assert resp.usage is not None
    assert resp.usage.completion_tokens == len("Hello from choice 0! The quick brown") + len(
        "Hello from choice 1"
    )


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
    # As OpenAI streams a call: its header (id, type, name, empty arguments), then the
    # arguments in fragments under the same index, as they arrive.
    head, *fragments = calls
    assert {c.index for c in calls} == {0} and len(fragments) > 1
    assert head.id and head.type == "function" and head.function is not None
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert all(f.id is None and f.function is not None and f.function.name is None for f in fragments)
    arguments = "".join(f.function.arguments or "" for f in fragments if f.function is not None)
    assert arguments == '{"city": "Paris"}'
    assert finish == "tool_calls"


def test_tools_stream_assembled_by_the_sdk(client: openai.OpenAI) -> None:
    """The openai SDK's stream helper assembles the fragments into the same call as the
    non-streamed response (same arguments text)."""
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    messages = [{"role": "user", "content": "TOOL please"}]
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=tools) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)  # type: ignore[arg-type]
    calls, expected = final.choices[0].message.tool_calls or [], whole.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "tool_calls"
    assert (
        [(c.function.name, c.function.arguments) for c in calls]
        == [(c.function.name, c.function.arguments) for c in expected]
        == [("get_weather", '{"city": "Paris"}')]
    )


def test_tool_choice_none_keeps_text(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "TOOL"}], tools=tools, tool_choice="none"
    )
    assert "<tool_call>" in (resp.choices[0].message.content or "")
    assert resp.choices[0].finish_reason == "stop"


def json_mode_violations(http: httpx.Client) -> float:
    """meshserve_gateway_json_mode_violations_total as the gateway's /metrics shows it."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "meshserve_gateway_json_mode_violations_total":
                return float(sample.value)
    raise AssertionError("meshserve_gateway_json_mode_violations_total is not exported")


def test_json_object_mode(client: openai.OpenAI, http: httpx.Client) -> None:
    """No guided decoding: output that is not JSON is returned as is, but each such choice
    is counted (and logged); valid JSON is not."""
    before = json_mode_violations(http)
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON"}],
        response_format={"type": "json_object"},
        n=2,
    )
    assert json.loads(resp.choices[0].message.content or "") == {"answer": 42}
    assert resp.choices[1].message.content == "not json"  # returned as is, logged + counted
    assert json_mode_violations(http) == before + 1  # choice 1 only
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON"}],
        response_format={"type": "json_object"},
        n=2,
        stream=True,
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: '{"answer": 42}', 1: "not json"}
    assert json_mode_violations(http) == before + 2
    # Without json_object mode nothing is checked.
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON"}], n=2)
    assert json_mode_violations(http) == before + 2


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


def test_non_ascii_output_is_detokenized_utf8_safe(client: openai.OpenAI) -> None:
    """The fake model emits one token per UTF-8 byte for non-ASCII text: the in-process
    detokenizer holds partial characters back, so no chunk carries U+FFFD."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "UNICODE"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        pieces.extend(c.delta.content for c in chunk.choices if c.delta.content)
    assert "".join(pieces) == UNICODE_TEXT
    assert all("\ufffd" not in piece for piece in pieces), pieces
    assert usage is not None and usage.completion_tokens == len(UNICODE_TEXT.encode())
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "UNICODE"}])
    assert resp.choices[0].message.content == UNICODE_TEXT


def test_sampling_fields_and_priority_reach_the_worker(client: openai.OpenAI, harness: Harness) -> None:
    """Every sampling field the client set reaches the worker's GenerateRequest exactly
    (and nothing it did not set); vLLM priority (lower first) is negated for the mesh
    (higher first); cache salt and tenant ride along."""
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=2,
        temperature=0.5,
        top_p=0.75,
        seed=-5,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        extra_body={
            "top_k": 7,
            "min_p": 0.125,
            "repetition_penalty": 1.25,
            "min_tokens": 2,
            "stop_token_ids": [7, 9],
            "ignore_eos": True,
            "priority": 3,
            "cache_salt": "salt-1",
        },
    )
    assert [c.message.content for c in resp.choices] == [HELLO0[:6], HELLO0.replace("0", "1")[:6]]
    expected = common_pb2.SamplingParams(
        temperature=0.5,
        top_p=0.75,
        top_k=7,
        min_p=0.125,
        seed=-5,
        repetition_penalty=1.25,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        max_tokens=6,
        min_tokens=2,
        stop_token_ids=[7, 9],
        ignore_eos=True,
        n=2,
    )
    sent = harness.worker.last_request
    assert sent.request_id == resp.id
    assert sent.sampling == expected, sent.sampling
    assert sent.priority == -3
    assert sent.cache_salt == "salt-1" and sent.tenant == "anonymous" and sent.model == MODEL
    assert harness.scheduler.routes_of(resp.id)[0].request.priority == -3  # admission sees it too
    # The other sign, on the completions route, with logprobs on.
    completion = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, logprobs=1, extra_body={"priority": -2, "top_k": -1}
    )
    sent = harness.worker.last_request
    assert sent.request_id == completion.id
    assert sent.priority == 2
    assert sent.sampling == common_pb2.SamplingParams(max_tokens=2, n=1, top_k=-1, logprobs=1)


def test_requests_share_one_stream_per_worker(client: openai.OpenAI, harness: Harness) -> None:
    """The gateway multiplexes its requests on one GenerateStream per worker."""
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    opened = harness.worker.streams_opened
    for _ in range(3):
        client.completions.create(model=MODEL, prompt=["A", "B"], max_tokens=2)
    assert harness.worker.streams_opened == opened


def test_a_request_without_model_is_not_refused_on_a_stale_list(harness: Harness) -> None:
    """A request naming no model, while the cached worker list has only workers of
    another kind healthy (decoders down, the embedding worker up), asks for a list at most
    `models_cache_s` old before it answers 503: once the decoders are back, the first
    completion runs (it used to be answered from the stale list while a refresh ran)."""
    harness.scheduler.down.update(harness.scheduler.workers)
    gw = harness.start_gateway(harness.config(models_cache_s=0.2))
    clock = FakeClock(time.monotonic())  # not behind a list the gateway fetched at start
    gw.app.state.upstream.clock = clock
    try:
        with httpx.Client(base_url=gw.url, timeout=20) as http:
            refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            harness.scheduler.down.clear()
            clock.advance(0.19)  # the list is younger than models_cache_s: still answered from it
            refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            clock.advance(0.02)  # older than models_cache_s now
            completion = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert completion.status_code == 200, completion.text
            assert completion.json()["model"] == MODEL
    finally:
        harness.scheduler.down.clear()
        harness.stop_gateway(gw)


def test_a_request_without_model_gets_a_model_of_its_kind(harness: Harness) -> None:
    """With the embedding model listed first (as `make serve`'s scheduler lists it), a
    completion or chat naming no model runs on the language model, embeddings on the
    embedding model (the first listed model used to answer a completion with 404)."""
    harness.scheduler.embedding_first = True
    gw = harness.start_gateway(harness.config())
    try:
        with httpx.Client(base_url=gw.url, timeout=20) as http:
            completion = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert completion.status_code == 200, completion.text
            assert completion.json()["model"] == MODEL
            chat = http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert chat.status_code == 200 and chat.json()["model"] == MODEL, chat.text
            embedding = http.post("/v1/embeddings", json={"input": "hi"})
            assert embedding.status_code == 200 and embedding.json()["model"] == EMBED_MODEL, embedding.text
    finally:
        harness.scheduler.embedding_first = False
        harness.stop_gateway(gw)
