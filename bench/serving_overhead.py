"""What serving adds to concurrency-1 TTFT: meshserve's mesh over meshserve's engine
in-process, next to vLLM's OpenAI server over vLLM's engine in-process, on this host,
same model, same prompts, same HTTP client.

    python -m bench.serving_overhead --model-dir /tmp/peer/tiny-llama --rounds 3 \
        --num-requests 64 --out bench/results/serving_overhead.json

Each round runs four systems one at a time, in a shuffled order, each on the round's
prompts (128 random token ids, `--output-len` tokens, greedy, ignore_eos, sequential),
after `--warmup` requests of its own:
- `meshserve_inprocess`: `AsyncLLMEngine` in this process (the `mesh_overhead` baseline);
- `meshserve_mesh`: the full mesh (Redis, scheduler, tokenizer, one decoder, gateway)
  through `mesh_client.gateway_generate_fn` (aiohttp, streamed `/v1/completions`);
- `vllm_inprocess`: vLLM's `LLMEngine` with its engine core in the calling process
  (`bench/vllm_inprocess_ttft.py`, run by the vLLM venv's interpreter);
- `vllm_served`: `vllm serve` (its defaults: API server + engine-core process) through
  the same client as the mesh.
A system's added TTFT in a round is its served p50 minus its in-process p50; the report
gives the median over rounds. Each system runs at its own defaults (vLLM's CPU build
gives its engine one thread and keeps a core for its API server; meshserve's engine
uses torch's default threads): what is compared is what each serving stack adds to its
own engine, not the engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.engine_bench import (
    DEFAULT_VLLM_VENV,
    PAGE_SIZE,
    GenerateFn,
    VllmServer,
    Workload,
    engine_generate_fn,
    make_workload,
    percentiles,
    run_generate_workload,
    vllm_missing,
)
from bench.mesh_client import gateway_generate_fn, model_name, running_mesh
from bench.report import save
from worker_svc.engine import AsyncLLMEngine, EngineConfig

SYSTEMS = ("meshserve_inprocess", "meshserve_mesh", "vllm_inprocess", "vllm_served")
# served system -> its in-process baseline
PAIRS = {"meshserve_mesh": "meshserve_inprocess", "vllm_served": "vllm_inprocess"}
PROMPT_LEN = 128
# The engine settings of both meshserve systems (the in-process engine and the mesh's worker).
MAX_NUM_SEQS = 32
MAX_BATCH_TOKENS = 512

Runner = Callable[[argparse.Namespace, Workload], Awaitable[list[float]]]


async def _meshserve_inprocess(args: argparse.Namespace, workload: Workload) -> list[float]:
    config = EngineConfig(
        model_dir=args.model_dir,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCH_TOKENS,
        block_size=PAGE_SIZE,
        dtype=args.dtype,
    )
    engine = AsyncLLMEngine(config)
    engine.start()
    try:
        return await _ttfts(
            engine_generate_fn(engine, "warm"), engine_generate_fn(engine, "run"), workload, args
        )
    finally:
        await engine.shutdown()


async def _meshserve_mesh(args: argparse.Namespace, workload: Workload) -> list[float]:
    # The launcher waits for health with asyncio.run: start and stop it off the loop.
    env = (("MESHSERVE_DTYPE", args.dtype),)
    starting = running_mesh(args.model_dir, MAX_NUM_SEQS, MAX_BATCH_TOKENS, env)
    mesh = await asyncio.to_thread(starting.__enter__)
    try:
        return await _served_ttfts(mesh.gateway_url, model_name(args.model_dir), workload, args)
    finally:
        await asyncio.to_thread(starting.__exit__, None, None, None)


async def _vllm_served(args: argparse.Namespace, workload: Workload) -> list[float]:
    log = os.path.join(tempfile.mkdtemp(prefix="meshserve-bench-vllm-"), "vllm.log")
    server = VllmServer(args.vllm_venv, args.model_dir, args.dtype, log)
    try:
        await asyncio.to_thread(server.wait_ready)
        return await _served_ttfts(server.url, server.name, workload, args)
    finally:
        server.stop()


async def _vllm_inprocess(args: argparse.Namespace, workload: Workload) -> list[float]:
    """The warm-up prompts and the measured ones in one child process (one engine)."""
    prompts = _warmup_prompts(args) + workload.prompts
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    script = Path(__file__).with_name("vllm_inprocess_ttft.py")
    python = os.path.join(args.vllm_venv, "bin", "python")
    cmd = [python, str(script), f.name, str(workload.output_len), args.dtype, args.model_dir]
    try:
        done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=900)
    finally:
        os.unlink(f.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM in-process run failed ({done.returncode}): {done.stderr[-2000:]}")
    timings = json.loads(lines[-1][len("RESULT ") :])
    return [t["ttft_s"] for t in timings[args.warmup :]]


async def _served_ttfts(url: str, model: str, workload: Workload, args: argparse.Namespace) -> list[float]:
    """`_ttfts` through an OpenAI server's streamed `/v1/completions`, with the client
    `mesh_overhead` uses."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
        warm = gateway_generate_fn(client, url, model, "warm")
        run = gateway_generate_fn(client, url, model, "run")
        return await _ttfts(warm, run, workload, args)


async def _ttfts(
    warm: GenerateFn, run: GenerateFn, workload: Workload, args: argparse.Namespace
) -> list[float]:
    """TTFTs (s) of the workload run sequentially, after `args.warmup` requests."""
    await run_generate_workload(warm, Workload(_warmup_prompts(args), workload.output_len), 1, "warm")
    _, timings = await run_generate_workload(run, workload, 1, "run")
    return [t.first - t.submit for t in timings]


def _warmup_prompts(args: argparse.Namespace) -> list[list[int]]:
    return make_workload(args.model_dir, args.warmup, PROMPT_LEN, 1, seed=10_000).prompts


RUNNERS: dict[str, Runner] = {
    "meshserve_inprocess": _meshserve_inprocess,
    "meshserve_mesh": _meshserve_mesh,
    "vllm_inprocess": _vllm_inprocess,
    "vllm_served": _vllm_served,
}


def added_per_round(rounds: list[dict[str, float]]) -> dict[str, list[float]]:
    """Per served system, its TTFT p50 minus its in-process p50 in each round (ms)."""
    return {
        served: [r[served] - r[base] for r in rounds if served in r and base in r]
        for served, base in PAIRS.items()
    }


def summary(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over rounds of each system's TTFT p50 and each served system's added TTFT."""
    added = added_per_round(rounds)
    return {
        "ttft_p50_ms_median": {s: statistics.median(r[s] for r in rounds) for s in SYSTEMS if s in rounds[0]},
        "ttft_added_ms_median": {s: statistics.median(v) for s, v in added.items() if v},
        "ttft_added_ms_per_round": added,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    systems = [s for s in SYSTEMS if not (s.startswith("vllm") and args.skip_vllm)]
    rounds: list[dict[str, float]] = []
    runs: list[dict[str, Any]] = []
    for index in range(args.rounds):
        workload = make_workload(args.model_dir, args.num_requests, PROMPT_LEN, args.output_len, seed=index)
        order = systems[:]
        rng.shuffle(order)
        p50s: dict[str, float] = {}
        for system in order:
            ttfts = await RUNNERS[system](args, workload)
            p50s[system] = percentiles(ttfts)["p50"]
            runs.append({"round": index, "system": system, "ttft_ms": percentiles(ttfts)})
            print(f"round {index} {system}: TTFT p50 {p50s[system]:.2f} ms", flush=True)
        rounds.append(p50s)
    return {"rounds": rounds, "summary": summary(rounds), "runs": runs}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=64, help="measured requests per system and round")
    p.add_argument("--warmup", type=int, default=8, help="requests before the measured ones")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0, help="order of the systems in each round")
    p.add_argument("--vllm-venv", default=DEFAULT_VLLM_VENV)
    p.add_argument("--skip-vllm", action="store_true", help="meshserve's two systems only")
    p.add_argument("--out", default="bench/results/serving_overhead.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    missing = vllm_missing(args.vllm_venv)
    if missing and not args.skip_vllm:
        sys.exit(f"{missing} (or --skip-vllm)")
    results = asyncio.run(bench(args))
    report = save("bench.serving_overhead", argv, {"args": vars(args), **results}, args.out)
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
