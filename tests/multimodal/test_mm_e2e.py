"""End to end E/PD disaggregation: real processes (gateway, tokenizer, scheduler, encoder
cache, one encoder worker, one decoder worker) and real Redis, the tiny LLaVA-style model,
images sent as data URLs through the OpenAI API.

Checks: greedy output equals the single-process transformers reference token for token;
a repeated image is an encoder cache hit (no second vision-tower run); a small cache
evicts and the evicted image is encoded again; a dead encoder cache gives a clear 503
within seconds while text requests keep working."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from launcher.mesh import Mesh
from services.ports import free_port
from services.redis_client import RedisServer
from tests.mesh import metric_value, running_mesh
from tests.multimodal.conftest import ReferenceBuilder, chat_messages, png_bytes

MAX_TOKENS = 8
# Each image's embeddings take 16 x 64 float32 = 4096 bytes: the cache holds two.
CACHE_BYTES = 10_000
METRICS = ("scheduler", "encoder-cache", "encoder-0")


@pytest.fixture(scope="module")
def mm_mesh(
    vlm_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    with running_mesh(
        tmp_path_factory.mktemp("mm-mesh"),
        timeout=120,
        model_dir=str(vlm_dir),
        embedding_model_dir="",
        num_decoders=1,
        num_encoders=1,
        redis_url=redis_server.url,
        kv_cache_memory_mb=16,
        extra_env=(("MESHSERVE_CAPACITY_BYTES", str(CACHE_BYTES)), ("MESHSERVE_NUM_THREADS", "1")),
        metrics_ports=tuple((name, free_port()) for name in METRICS),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def client(mm_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mm_mesh.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metric(mm_mesh: Mesh, service: str, name: str, **labels: str) -> float:
    """A sample of a service's /metrics (0 when absent)."""
    return metric_value(dict(mm_mesh.config.metrics_ports)[service], name, **labels)


def ask(client: openai.OpenAI, png: bytes) -> tuple[str, int, int]:
    """(text, completion tokens, cached prompt tokens) of a greedy chat completion."""
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=chat_messages(png),
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    assert reply.usage is not None
    details = reply.usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return reply.choices[0].message.content or "", reply.usage.completion_tokens, cached


def expected(refs: ReferenceBuilder, png: bytes) -> tuple[str, int]:
    """(text, number of tokens) transformers generates greedily from the same inputs."""
    tokens = refs.greedy(refs.reference(png), MAX_TOKENS)
    return refs.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)


def _counters(mm_mesh: Mesh) -> dict[str, float]:
    """The counters the cache-hit test reads (it compares them before and after: the module's
    tests run in any order, and one restarts the encoder cache)."""
    lookups = "meshserve_scheduler_encoder_cache_lookups_total"
    return {
        "encoded": metric(mm_mesh, "encoder-0", "meshserve_encoder_items_total"),
        "queued": metric(mm_mesh, "encoder-0", "meshserve_encoder_queue_seconds_count"),
        "hit": metric(mm_mesh, "scheduler", lookups, result="hit"),
        "miss": metric(mm_mesh, "scheduler", lookups, result="miss"),
        "cache_hits": metric(mm_mesh, "encoder-cache", "meshserve_encoder_cache_hits_total"),
    }


def test_repeated_image_is_an_encoder_cache_hit(
    mm_mesh: Mesh, client: openai.OpenAI, refs: ReferenceBuilder
) -> None:
    image = png_bytes(31)  # no other test of the module sends it
    text, count = expected(refs, image)
    before = _counters(mm_mesh)
    first = ask(client, image)
    assert first[:2] == (text, count)
    assert _counters(mm_mesh)["encoded"] == before["encoded"] + 1
    second = ask(client, image)
    assert second[:2] == first[:2]
    assert second[2] > 0  # same image: its KV blocks are reused too
    after = _counters(mm_mesh)
    assert {k: after[k] - before[k] for k in after} == {
        "encoded": 1,  # no second encode
        "queued": 1,
        "hit": 1,
        "miss": 1,
        "cache_hits": 2,  # the decoder's reads
    }


def test_completion_prompt_with_the_image_placeholder_is_refused(
    client: openai.OpenAI, refs: ReferenceBuilder
) -> None:
    # The gateway renders completion prompts itself: it learns the placeholder from
    # GetTokenizerInfo and refuses it, in text or as an id, like the tokenizer service.
    model = client.models.list().data[0].id
    for prompt in ("look: <image> here", [1, refs.image_token, 2]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt=prompt, max_tokens=2)  # type: ignore[arg-type]
        body = info.value.body
        assert isinstance(body, dict) and body.get("param") == "prompt", body
        assert "image placeholder" in str(body.get("message")), body


def test_small_cache_evicts_and_reencodes(
    mm_mesh: Mesh, client: openai.OpenAI, refs: ReferenceBuilder
) -> None:
    first, second, third = png_bytes(11), png_bytes(12), png_bytes(13)
    evictions = metric(mm_mesh, "encoder-cache", "meshserve_encoder_cache_evictions_total")
    assert ask(client, first)[:2] == expected(refs, first)  # cached now, whatever ran before
    before = metric(mm_mesh, "encoder-0", "meshserve_encoder_items_total")
    for image in (second, third):  # the cache holds two images: the first one goes
        reply = ask(client, image)
        assert reply[:2] == expected(refs, image)
        assert reply[2] == 0  # same prompt tokens as the first image, different image: no KV reuse
    assert metric(mm_mesh, "encoder-cache", "meshserve_encoder_cache_evictions_total") >= evictions + 1
    assert metric(mm_mesh, "encoder-cache", "meshserve_encoder_cache_bytes") <= CACHE_BYTES
    again = ask(client, first)
    assert again[:2] == expected(refs, first)
    assert metric(mm_mesh, "encoder-0", "meshserve_encoder_items_total") == before + 3


def _images_served_again(client: openai.OpenAI, timeout_s: float = 60.0) -> None:
    """Waits until an image request is answered (the clients' channels reconnect)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ask(client, png_bytes(41))
            return
        except openai.APIStatusError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _text_still_served(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    text = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    assert text.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_encoder_worker_lost_is_a_bounded_clear_error_then_recovers(
    mm_mesh: Mesh, client: openai.OpenAI, refs: ReferenceBuilder, sig: signal.Signals
) -> None:
    """The only encoder worker killed (or hung): an image request is answered with a clear
    503 naming the encoder within the bound (keepalive finds a hung one), text requests
    are unaffected; once it is back (restarted / SIGCONT) images are served again."""
    image = png_bytes(21 + int(sig))  # not cached: it must be encoded
    mm_mesh.procs["encoder-0"].send_signal(sig)
    try:
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failure:
            ask(client, image)
        refused_s = time.monotonic() - start
        _text_still_served(client)
    finally:
        if sig == signal.SIGSTOP:
            mm_mesh.procs["encoder-0"].send_signal(signal.SIGCONT)
        else:
            mm_mesh.procs["encoder-0"].wait(10)
            mm_mesh.start_service(mm_mesh.specs["encoder-0"])
    assert failure.value.status_code == 503, failure.value
    assert "encoder" in str(failure.value).lower(), failure.value
    assert refused_s < 30, refused_s
    deadline = time.monotonic() + 60
    while True:  # the scheduler lists it again after its next heartbeat
        try:
            assert ask(client, image)[:2] == expected(refs, image)
            break
        except openai.APIStatusError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    print(f"[multimodal] encoder-0 {sig.name}: image request 503 in {refused_s:.1f}s; text served; recovered")


def test_encoder_cache_down_is_a_fast_clear_error(mm_mesh: Mesh, client: openai.OpenAI) -> None:
    mm_mesh.stop_service("encoder-cache")
    try:
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failure:
            ask(client, png_bytes(41))
        refused_s = time.monotonic() - start
    finally:  # the module's other tests, in whatever order they run, need it back
        mm_mesh.start_service(mm_mesh.specs["encoder-cache"])
        mm_mesh.wait_healthy(60)
        _images_served_again(client)
    assert refused_s < 15
    assert failure.value.status_code == 503
    assert "encoder cache" in str(failure.value)
    model = client.models.list().data[0].id
    text = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    assert text.choices[0].finish_reason in ("stop", "length")
