"""End to end: real processes for every service, real Redis, the real model, and the
official `openai` client against the gateway."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Completion
from transformers import AutoTokenizer

from tests.mesh import RunningMesh, metric_value
from worker_svc.engine import EngineConfig, LLMEngine, RequestSpec, SamplingParams

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello, who are you?"},
]


@pytest.fixture(scope="module")
def client(e2e_mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=e2e_mesh.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI, model_dir: Path) -> str:
    models = {m.id for m in client.models.list().data}
    assert model_dir.name in models
    return model_dir.name


def _chat_prompt_tokens(model_dir: Path) -> int:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return len(encoded["input_ids"])


def test_chat_completion_non_streaming(client: openai.OpenAI, model_name: str, model_dir: Path) -> None:
    reply = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == _chat_prompt_tokens(model_dir)
    assert 1 <= reply.usage.completion_tokens <= 12
    assert choice.logprobs is not None and choice.logprobs.content is not None
    if choice.finish_reason == "length":
        # One token generated per logprob entry, as many as usage counts.
        assert reply.usage.completion_tokens == len(choice.logprobs.content) == 12


def test_chat_completion_streaming_matches_non_streaming(client: openai.OpenAI, model_name: str) -> None:
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_greedy_output_equals_the_in_process_engine_token_for_token(
    client: openai.OpenAI, model_name: str, model_dir: Path
) -> None:
    """The mesh adds no numerical or token-path difference: the same prompt ids through the
    gateway → worker stream → in-gateway detokenizer give exactly the tokens (and text) of
    the engine run in this process with the worker's settings."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.encode("The function returns the value of")
    dtype = os.environ["MESHSERVE_DTYPE"]  # the mesh's worker's (tests/conftest.py)
    engine = LLMEngine(
        EngineConfig(model_dir=str(model_dir), dtype=dtype, num_kv_blocks=64, compile_model=False)
    )
    engine.add_request(
        RequestSpec("local", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    )
    expected: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            expected.extend(out.new_token_ids)
    reply = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected) == 24
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in expected]
    assert choice.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_requests_share_one_stream_to_the_decoder(
    e2e_mesh: RunningMesh, client: openai.OpenAI, model_name: str
) -> None:
    """The gateway's token path to the decoder is one GenerateStream, opened once and
    shared by every request."""
    for _ in range(3):
        client.completions.create(model=model_name, prompt="Hello", max_tokens=2)
    port = int(e2e_mesh.gateway_url.rsplit(":", 1)[1])
    assert metric_value(port, "meshserve_gateway_worker_streams_opened_total") == 1


def test_completion_and_prefix_cache_reuse(client: openai.OpenAI, model_name: str) -> None:
    prompt = "The function returns the value of the first argument. " * 6
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    assert first.choices[0].text == second.choices[0].text
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) > 0


def test_parallel_samples_logprobs_and_stop(client: openai.OpenAI, model_name: str) -> None:
    reply = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage is not None
    tokens = 0
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        tokens += len(choice.logprobs.content)
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
    assert reply.usage.completion_tokens == tokens
    again = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7, n=2
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]

    # A stop string cuts the text before it and finishes with "stop". The stop string is
    # taken from a first greedy run's own text (EOS ignored, so it runs all 16 tokens):
    # the identical greedy rerun is certain to generate it, in its first third.
    def greedy(stop: list[str] | None = None) -> Completion:
        return client.completions.create(
            model=model_name,
            prompt="The function",
            max_tokens=16,
            temperature=0,
            stop=stop,
            extra_body={"ignore_eos": True},
        )

    base = greedy()
    text = base.choices[0].text
    assert base.choices[0].finish_reason == "length" and base.usage is not None
    assert base.usage.completion_tokens == 16
    assert len(text) >= 8, repr(text)
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    cut = greedy([stop])
    assert cut.choices[0].finish_reason == "stop", (text, stop, cut.choices[0].text)
    assert cut.choices[0].text == text[: text.index(stop)], (text, stop)
    # Generation stopped there (fewer tokens), not just the text trimmed afterwards.
    assert cut.usage is not None and cut.usage.completion_tokens < 16


def test_tokenize_detokenize_and_embeddings(
    e2e_mesh: RunningMesh, client: openai.OpenAI, model_name: str
) -> None:
    tokens = httpx.post(
        e2e_mesh.gateway_url + "/tokenize", json={"model": model_name, "prompt": "héllo wörld"}, timeout=30
    )
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    text = httpx.post(
        e2e_mesh.gateway_url + "/detokenize", json={"model": model_name, "tokens": ids}, timeout=30
    )
    assert text.status_code == 200 and "héllo wörld" in text.json()["prompt"]
    embedding_model = next(m.id for m in client.models.list().data if m.id != model_name)
    vectors = client.embeddings.create(
        model=embedding_model, input=["a cat sits", "a cat is sitting", "stock prices"]
    )
    values = [v.embedding for v in vectors.data]
    assert len(values) == 3 and len(values[0]) == 384

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cosine(values[0], values[1]) > cosine(values[0], values[2])
    metrics = httpx.get(e2e_mesh.gateway_url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "meshserve_gateway" in metrics.text


def test_bad_input_is_400_naming_the_field(e2e_mesh: RunningMesh, model_name: str) -> None:
    reply = httpx.post(
        e2e_mesh.gateway_url + "/v1/chat/completions",
        json={"model": model_name, "messages": MESSAGES, "max_tokens": -1},
        timeout=30,
    )
    assert reply.status_code == 400
    assert "max_tokens" in reply.json()["error"]["message"] + str(reply.json()["error"].get("param"))


def test_killing_a_service_shows_in_health(e2e_mesh: RunningMesh) -> None:
    assert httpx.get(e2e_mesh.gateway_url + "/health", timeout=10).status_code == 200
    e2e_mesh.stop_service("tokenizer")
    try:
        deadline = time.monotonic() + 20
        status = 200
        while time.monotonic() < deadline and status == 200:
            status = httpx.get(e2e_mesh.gateway_url + "/health", timeout=10).status_code
            time.sleep(0.2)
        assert status == 503
        assert "tokenizer" in httpx.get(e2e_mesh.gateway_url + "/health", timeout=10).text
    finally:
        e2e_mesh.start_service(e2e_mesh.specs["tokenizer"])
        e2e_mesh.wait_healthy(60)
    assert httpx.get(e2e_mesh.gateway_url + "/health", timeout=10).status_code == 200


def _scheduler_series(e2e_mesh: RunningMesh, name: str) -> float:
    """The sum of a scheduler metric's samples (every label set)."""
    port = dict(e2e_mesh.config.metrics_ports)["scheduler"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    )


def test_every_request_routes_and_releases_its_lease(
    e2e_mesh: RunningMesh, client: openai.OpenAI, model_name: str
) -> None:
    """Requests one after another each route on the gateway's route stream (one route per
    request, no lease held ahead of one) and give their lease back when they end: the
    replica counts every lease released by the gateway and holds none afterwards."""
    port = dict(e2e_mesh.config.metrics_ports)["scheduler"]
    routed = _scheduler_series(e2e_mesh, "meshserve_scheduler_routed_total")
    released = metric_value(port, "meshserve_scheduler_leases_ended_total", how="released")
    for _ in range(8):
        reply = client.completions.create(model=model_name, prompt="route me", max_tokens=2)
        assert reply.choices[0].text is not None
    assert _scheduler_series(e2e_mesh, "meshserve_scheduler_routed_total") - routed == 8
    deadline = time.monotonic() + 10
    while _scheduler_series(e2e_mesh, "meshserve_scheduler_leases") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # releases go back in 20 ms batches
    assert _scheduler_series(e2e_mesh, "meshserve_scheduler_leases") == 0
    assert metric_value(port, "meshserve_scheduler_leases_ended_total", how="released") - released == 8
