"""P/D disaggregation end to end: real processes (gateway, tokenizer, scheduler, one decoder,
one prefill worker, Redis), the official `openai` client. Long uncached prompts are
prefilled on the prefill worker and their KV pulled by the decoder; greedy output equals
the in-process engine's token for token (text prompts, prompts partly cached on the
decoder, prompts longer than the chunk size); a corrupted block and a prefill worker
killed under load cost no request and no token; no KV block stays in use on either side."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from services.ports import free_port
from services.redis_client import RedisServer
from tests.mesh import RunningMesh, running_mesh
from worker_svc.engine import EngineConfig, LLMEngine, RequestSpec, SamplingParams
from worker_svc.kv_grpc import FAULT_ENV

WORKERS = ["decoder-0", "prefill-0"]
MAX_TOKENS = 12
CHUNK = 32  # max_num_batched_tokens of both workers: longer prompts are prefilled in chunks
PD_MIN = 24  # the scheduler's pd_min_prompt_tokens
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words))


@contextlib.contextmanager
def pd_mesh(
    path: Path, model_dir: Path, redis_server: RedisServer, *scheduler_env: tuple[str, str]
) -> Iterator[RunningMesh]:
    with running_mesh(
        path,
        model_dir=str(model_dir),
        num_decoders=1,
        num_prefill=1,
        embedding_model_dir="",
        redis_url=redis_server.url,
        kv_cache_memory_mb=16,
        metrics_ports=tuple((name, free_port()) for name in ("scheduler", *WORKERS)),
        extra_env=(
            ("MESHSERVE_PD_MIN_PROMPT_TOKENS", str(PD_MIN)),
            *scheduler_env,
            ("MESHSERVE_MAX_NUM_BATCHED_TOKENS", str(CHUNK)),
            ("MESHSERVE_NUM_THREADS", "1"),
        ),
    ) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def pd(
    model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningMesh]:
    with pd_mesh(
        tmp_path_factory.mktemp("pd-mesh"),
        model_dir,
        redis_server,
        ("MESHSERVE_PD_DECISION", "threshold"),  # the hand-off path under test, every time
        ("MESHSERVE_PD_PREFILL_DECODES", "false"),  # and never a whole request on prefill-0
    ) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def client(pd: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLMEngine:
    """The worker's engine in this process, unchunked, no P/D: what every answer must equal."""
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype=os.environ["MESHSERVE_DTYPE"],
            num_kv_blocks=256,
            compile_model=False,
        )
    )


def expected(engine: LLMEngine, ids: list[int]) -> list[int]:
    engine.add_request(
        RequestSpec("ref", ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    )
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def complete(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, int]:
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS
    return reply.choices[0].text, reply.usage.prompt_tokens


def check(client: openai.OpenAI, model: str, engine: LLMEngine, tokenizer: object, prompt: str) -> int:
    """One greedy completion through the mesh equals the reference; returns its prompt length."""
    ids = tokenizer.encode(prompt)  # type: ignore[attr-defined]
    got, prompt_tokens = complete(client, model, prompt)
    assert prompt_tokens == len(ids)
    assert got == tokenizer.decode(expected(engine, ids), skip_special_tokens=True)  # type: ignore[attr-defined]
    return len(ids)


def count(mesh: RunningMesh, name: str, metric: str, **labels: str) -> float:
    return mesh.metric(name, metric, **labels)


def test_pd_greedy_equals_one_engine(
    pd: RunningMesh, client: openai.OpenAI, model_name: str, reference: LLMEngine, model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    imported = count(pd, "decoder-0", "meshserve_worker_kv_transfers_total", outcome="imported")
    sent = count(pd, "prefill-0", "meshserve_worker_kv_transfer_bytes_total", direction="sent")
    long_prompt = text(1, 60)
    assert check(client, model_name, reference, tokenizer, long_prompt) > 2 * CHUNK  # chunked on P
    # Partly in the decoder's prefix cache now: only the new part is uncached (>= PD_MIN).
    check(client, model_name, reference, tokenizer, long_prompt + " " + text(2, 40))
    assert check(client, model_name, reference, tokenizer, text(3, 5)) < PD_MIN  # short: decoder only
    assert count(pd, "decoder-0", "meshserve_worker_kv_transfers_total", outcome="imported") == imported + 2
    assert count(pd, "prefill-0", "meshserve_worker_kv_transfer_bytes_total", direction="sent") > sent
    assert count(pd, "decoder-0", "meshserve_worker_kv_transfers_total", outcome="fallback") == 0
    pd.wait_kv_idle(timeout=30, names=WORKERS)


def test_corrupted_block_falls_back_with_the_same_output(
    pd: RunningMesh, client: openai.OpenAI, model_name: str, reference: LLMEngine, model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = pd.specs["decoder-0"]
    faulty = dataclasses.replace(spec, env={**spec.env, FAULT_ENV: "corrupt"})
    try:
        pd.specs["decoder-0"] = faulty
        pd.restart("decoder-0")
        pd.wait_registered("decoder-0")
        before = count(pd, "decoder-0", "meshserve_worker_kv_transfer_fallbacks_total", reason="checksum")
        check(client, model_name, reference, tokenizer, text(4, 70))
        assert (
            count(pd, "decoder-0", "meshserve_worker_kv_transfer_fallbacks_total", reason="checksum")
            == before + 1
        )
        pd.wait_kv_idle(timeout=30, names=WORKERS)
    finally:
        pd.specs["decoder-0"] = spec
        pd.restart("decoder-0")
        pd.wait_registered("decoder-0")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill9_prefill_worker_under_load_fails_no_request(
    pd: RunningMesh, client: openai.OpenAI, model_name: str, reference: LLMEngine, model_dir: Path
) -> None:
    """16 concurrent long prompts; the prefill worker is killed (-9) while they run: every
    request still answers with the reference's tokens (its decoder prefills itself)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [text(10 + i, 50) for i in range(24)]
    wanted = {
        p: tokenizer.decode(expected(reference, tokenizer.encode(p)), skip_special_tokens=True)
        for p in prompts
    }

    def one(prompt: str) -> str:
        return complete(client, model_name, prompt)[0]

    imported = count(pd, "decoder-0", "meshserve_worker_kv_transfers_total", outcome="imported")
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        # Killed once the first hand-off has landed (not after a fixed sleep, which an idle
        # host outran): the prompts still waiting for a thread are routed to a dead worker.
        deadline = time.monotonic() + 120
        while count(pd, "decoder-0", "meshserve_worker_kv_transfers_total", outcome="imported") == imported:
            assert time.monotonic() < deadline, "no hand-off landed"
            time.sleep(0.05)
        pd.kill("prefill-0")
        answers = [f.result() for f in futures]
    assert answers == [wanted[p] for p in prompts]
    assert count(pd, "decoder-0", "meshserve_worker_kv_transfers_total", outcome="fallback") > 0
    pd.wait_kv_idle(timeout=30, names=["decoder-0"])
    pd.restart("prefill-0")
    pd.wait_registered("prefill-0")
    pd.wait_kv_idle(timeout=30, names=WORKERS)


def stopped_run(
    mesh: RunningMesh,
    client: openai.OpenAI,
    model: str,
    reference: LLMEngine,
    tokenizer: object,
    seed: int,
    stop_when: Callable[[], bool] | None,
) -> tuple[list[str], list[str], float]:
    """24 prompts, 16 at a time; with ``stop_when``, prefill-0 is SIGSTOPped once it holds:
    the answers, the reference's and the slowest request's seconds."""
    # A leading number per prompt: text() repeats every 17 seeds, and a prompt cached on
    # the decoder by an earlier run would need no hand-off.
    prompts = [f"{seed + i} " + text(seed + i, 50 if i % 2 else 6) for i in range(24)]

    def one(prompt: str) -> tuple[str, float]:
        started = time.monotonic()
        return complete(client, model, prompt)[0], time.monotonic() - started

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        if stop_when is not None:
            deadline = time.monotonic() + 120
            while not stop_when():
                assert time.monotonic() < deadline, "prefill-0 never got its part of the load"
                time.sleep(0.05)
            mesh.kill("prefill-0", signal.SIGSTOP)
        done = [f.result() for f in futures]
    wanted = [
        tokenizer.decode(expected(reference, tokenizer.encode(p)), skip_special_tokens=True)  # type: ignore[attr-defined]
        for p in prompts
    ]
    return [answer for answer, _ in done], wanted, max(seconds for _, seconds in done)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigstop_prefill_worker_under_load_delays_no_request(
    pd: RunningMesh, client: openai.OpenAI, model_name: str, reference: LLMEngine, model_dir: Path
) -> None:
    """16 concurrent prompts, long and short; the prefill worker is stopped (SIGSTOP:
    alive, silent) once the first hand-off has landed. Every request answers with the
    reference's tokens, none more than 2 s later than the slowest of a no-fault run of the
    same load (its hand-offs fail within a second and prefill on the decoder), and no KV
    block stays in use once the worker continues."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    imported = count(pd, "decoder-0", "meshserve_worker_kv_transfers_total", outcome="imported")

    def landed() -> bool:
        return count(pd, "decoder-0", "meshserve_worker_kv_transfers_total", outcome="imported") > imported

    answers, wanted, calm_s = stopped_run(pd, client, model_name, reference, tokenizer, 200, None)
    assert answers == wanted
    imported = count(pd, "decoder-0", "meshserve_worker_kv_transfers_total", outcome="imported")
    try:
        answers, wanted, stopped_s = stopped_run(pd, client, model_name, reference, tokenizer, 300, landed)
        assert answers == wanted
        assert stopped_s <= calm_s + 2.0, (
            f"slowest request {stopped_s:.1f} s against {calm_s:.1f} s without the stop"
        )
        assert (
            count(pd, "decoder-0", "meshserve_worker_kv_transfer_fallbacks_total", reason="unavailable") > 0
        )
        pd.wait_kv_idle(timeout=30, names=["decoder-0"])
    finally:
        pd.kill("prefill-0", signal.SIGCONT)
    pd.wait_registered("prefill-0")
    pd.wait_kv_idle(timeout=30, names=WORKERS)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigstop_prefill_worker_running_whole_requests_delays_none(
    model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, reference: LLMEngine
) -> None:
    """The scheduler's defaults (prefill workers take whole requests, the estimate
    decides): the prefill worker is stopped while requests run whole on it. The gateway's
    keepalive finds its streams hung within about a second and they move to the decoder:
    every answer equals the reference, none more than 2 s later than the slowest of a
    no-fault run, no KV block stays in use once the worker continues."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with pd_mesh(tmp_path_factory.mktemp("pd-defaults"), model_dir, redis_server) as mesh:
        client = openai.OpenAI(
            base_url=mesh.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120
        )
        model = client.models.list().data[0].id

        def running_there() -> bool:
            return mesh.metric("scheduler", "meshserve_scheduler_worker_inflight", worker_id="prefill-0") >= 2

        answers, wanted, calm_s = stopped_run(mesh, client, model, reference, tokenizer, 400, None)
        assert answers == wanted
        try:
            answers, wanted, stopped_s = stopped_run(
                mesh, client, model, reference, tokenizer, 500, running_there
            )
            assert answers == wanted
            assert stopped_s <= calm_s + 2.0, (
                f"slowest request {stopped_s:.1f} s against {calm_s:.1f} s without the stop"
            )
            mesh.wait_kv_idle(timeout=30, names=["decoder-0"])
        finally:
            mesh.kill("prefill-0", signal.SIGCONT)
        mesh.wait_registered("prefill-0")
        mesh.wait_kv_idle(timeout=30, names=WORKERS)
