"""A burst of long prompts on one machine: 1 prefill + 1 decode worker (each on half the
cores) against one decoder on all of them, the total time of the same burst.

    python -m bench.pd_burst [--model-dir DIR] [--prompts 24 --prompt-len 800
        --concurrency 8 --max-tokens 24] [--rounds 3] [--pd-decision estimate]
        [--out bench/results/pd_burst.json]

Each round streams ``--prompts`` distinct random-token prompts (a round-unique cache salt:
no prefix cache helps), ``--concurrency`` at a time, ``--max-tokens`` each, and records
the wall time and the TTFT p50/p99. Both meshes (``pd``: ``--num-prefill 1``; ``single``:
one decoder) run at once, idle but for the one under load, the rounds alternating; the
forward is compiled as `make serve` runs it. The JSON keeps every round, the medians, the
ratio of the median wall times (pd / single: a disaggregated deployment should be no
slower than the colocated one it replaces) and decoder-0's hand-offs and the scheduler's
P/D decisions over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.host import host_info
from bench.mesh_client import completion_body, engine_lines
from bench.pd_bench import (
    DEFAULT_MODEL,
    BenchConfig,
    counters,
    difference,
    start_mesh,
    stream,
    vocab_size,
    wait_workers,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pd_burst.json"
MODES = ("pd", "single")


async def burst(
    args: argparse.Namespace, base_url: str, model: str, vocab: int, salt: str
) -> dict[str, float]:
    rng = random.Random(salt)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    gate = asyncio.Semaphore(args.concurrency)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> float:
        async with gate:
            body = completion_body(model, prompt, args.max_tokens, salt)
            return (await stream(client, base_url, body, "long")).ttft

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        started = time.perf_counter()
        ttfts = sorted(await asyncio.gather(*(one(client, p) for p in prompts)))
        wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "ttft_ms_p50": statistics.median(ttfts) * 1000,
        "ttft_ms_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1000,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = BenchConfig(model_dir=args.model_dir, pd_decision=args.pd_decision)
    meshes = {}
    try:
        for mode in MODES:
            meshes[mode] = start_mesh(config, mode)
            asyncio.run(wait_workers(meshes[mode].gateway_url, mode))
        model, vocab = Path(args.model_dir).name, vocab_size(args.model_dir)
        before = {mode: counters(mesh) for mode, mesh in meshes.items()}
        rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for i in range(args.rounds):
            for mode, mesh in meshes.items():
                rounds[mode].append(
                    asyncio.run(burst(args, mesh.gateway_url, model, vocab, f"{mode}-{i}-{time.time()}"))
                )
                print(f"round {i} {mode}: {json.dumps(rounds[mode][-1])}", flush=True)
        results: dict[str, Any] = {
            mode: {
                "engines": engine_lines(mesh),
                "rounds": rounds[mode],
                "median": {key: statistics.median(r[key] for r in rounds[mode]) for key in rounds[mode][0]},
                "counters": difference(counters(mesh), before[mode]),
            }
            for mode, mesh in meshes.items()
        }
    finally:
        for mesh in meshes.values():
            mesh.stop()
    results["wall_pd_to_single"] = results["pd"]["median"]["wall_s"] / results["single"]["median"]["wall_s"]
    return results


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pd_burst", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=800)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pd-decision", default="estimate")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    report = {
        "command": "python -m bench.pd_burst " + " ".join(argv),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "host": host_info(),
        "results": measure(args),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
