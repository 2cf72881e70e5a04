"""Decoders sharing KV under a fault: real processes (gateway, tokenizer, scheduler, two
decoders sharing prefixes, Redis), the official `openai` client. decoder-0 holds a long
prefix and is stopped (SIGSTOP); 16 concurrent prompts that extend it are routed, the
other decoder pulling the prefix from the holder (KvTransfer); 0.7 s later the holder is
killed (-9) with those pulls in flight. Every request answers with the in-process
engine's greedy tokens (those pulls fall back to a local prefill, the holder's streams
migrate), and no KV block stays in use."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from services.ports import free_port
from services.redis_client import RedisServer
from tests.e2e.test_pd_mesh import MAX_TOKENS, complete, expected, reference, text  # noqa: F401
from tests.mesh import RunningMesh, running_mesh

WORKERS = ["decoder-0", "decoder-1"]
SHARE_MIN = 24  # the scheduler's kv_share_min_tokens


@pytest.fixture(scope="module")
def sharing(
    model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningMesh]:
    """Two decoders that pull a prefix from each other (KV sharing)."""
    with running_mesh(
        tmp_path_factory.mktemp("kv-share-mesh"),
        model_dir=str(model_dir),
        num_decoders=2,
        embedding_model_dir="",
        redis_url=redis_server.url,
        kv_cache_memory_mb=16,
        metrics_ports=tuple((name, free_port()) for name in ("scheduler", *WORKERS)),
        extra_env=(
            ("MESHSERVE_KV_SHARE_MIN_TOKENS", str(SHARE_MIN)),
            ("MESHSERVE_MAX_NUM_BATCHED_TOKENS", "32"),
        ),
    ) as mesh:
        yield mesh


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill9_of_a_decoder_others_pull_from_fails_no_request(
    sharing: RunningMesh,
    reference: object,  # noqa: F811 - the P/D tests' in-process engine fixture
    model_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    client = openai.OpenAI(base_url=sharing.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prefix = text(1, 70)
    prompts = [f"{prefix} {text(20 + i, 6)}" for i in range(24)]
    wanted = {
        p: tokenizer.decode(expected(reference, tokenizer.encode(p)), skip_special_tokens=True)  # type: ignore[arg-type]
        for p in prompts
    }

    def finished() -> dict[str, float]:
        return {name: sharing.metric(name, "meshserve_worker_num_finished") for name in WORKERS}

    def fallbacks(name: str) -> float:
        return sharing.metric(name, "meshserve_worker_kv_transfers_total", outcome="fallback")

    before = finished()
    assert complete(client, model, prefix)[0]
    deadline = time.monotonic() + 30
    while (now := finished()) == before:
        assert time.monotonic() < deadline, "no decoder reported the prefix request finished"
        time.sleep(0.1)
    holder = next(name for name in WORKERS if now[name] > before[name])
    puller = next(name for name in WORKERS if name != holder)
    fell_back = fallbacks(puller)
    # Stopped before the load, so that the pulls from it are in flight at the kill (a tiny
    # model's pull is over in milliseconds), for less than the scheduler takes to see its
    # heartbeats stop.
    sharing.kill(holder, signal.SIGSTOP)
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(lambda p=p: complete(client, model, p)[0]) for p in prompts]
        time.sleep(0.7)
        sharing.kill(holder)
        answers = [f.result() for f in futures]
    assert fallbacks(puller) > fell_back, "no pull was in flight when the holder died"
    assert answers == [wanted[p] for p in prompts]
    sharing.wait_kv_idle(timeout=30, names=[puller])
    sharing.restart(holder)
    sharing.wait_registered(holder)
    sharing.wait_kv_idle(timeout=30, names=WORKERS)
