"""Several engines on one machine: the same chat load through a mesh of 1 decoder and
one of 2, each placed by the launcher on the machine's CPUs as `make serve` would
(services.cpus). With the machine's cores shared, twice the decoders must do at least as
much work per second as one.

    python -m bench.engines_bench --model-dir /tmp/peer/tiny-llama [--decoders 1,2]
        [--requests 60 --concurrency 16 --max-tokens 200] [--rounds 3]
        [--forward eager,compiled] [--out bench/results/engines_bench.json]

For each forward (eager, and compiled as `make serve` runs it) both meshes run at once,
idle but for the one under load, and the rounds alternate between them. Each round sends `--requests` streamed chat completions (`--max-tokens` tokens each,
ignore_eos), `--concurrency` at a time, and records the wall time, output tokens/s and
the median and p90 stream duration; the JSON keeps every round, their medians, where the
launcher put each engine (its CPUs and threads) and how many requests each one served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.host import host_info
from bench.mesh_client import cpu_seconds, metric_sample, sse_lines
from launcher.mesh import Mesh, free_ports_config
from services.cpus import format_cpus
from services.ports import free_port


async def _one_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, int]:
    """Streams one chat; returns its duration and the completion tokens of its usage."""
    start = time.perf_counter()
    tokens = 0
    async for line in sse_lines(session, url, body):
        # Only the usage event is decoded (no JSON parse per chunk).
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line[6:]).get("usage") or {}
            tokens = usage.get("completion_tokens", tokens)
    return time.perf_counter() - start, tokens


async def _load(base_url: str, model: str, args: argparse.Namespace, round_no: int) -> dict[str, float]:
    """One round: `requests` chats, `concurrency` in flight."""
    gate = asyncio.Semaphore(args.concurrency)
    url = base_url + "/v1/chat/completions"

    async def chat(i: int, session: aiohttp.ClientSession) -> tuple[float, int]:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Round {round_no}, story {i}: tell me about the sea."}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with gate:
            return await _one_chat(session, url, body)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        done = await asyncio.gather(*(chat(i, session) for i in range(args.requests)))
        wall = time.perf_counter() - start
    durations = sorted(d for d, _ in done)
    return {
        "wall_s": wall,
        "output_tok_s": sum(t for _, t in done) / wall,
        "stream_s_p50": statistics.median(durations),
        "stream_s_p90": durations[int(0.9 * (len(durations) - 1))],
    }


def _round(mesh: Mesh, args: argparse.Namespace, round_no: int) -> dict[str, Any]:
    """One recorded round, with the CPU seconds each process (and this client) used in it."""
    before = cpu_seconds(mesh, client=True)
    result: dict[str, Any] = asyncio.run(_load(mesh.gateway_url, Path(args.model_dir).name, args, round_no))
    after = cpu_seconds(mesh, client=True)
    result["cpu_s"] = {
        name: round(after[name] - before[name], 2) for name in sorted(after.keys() & before.keys())
    }
    return result


def _start_mesh(
    args: argparse.Namespace, decoders: int, compiled: bool
) -> tuple[Mesh, tuple[tuple[str, int], ...]]:
    """A mesh of `decoders` decoders placed by the launcher, warmed up by one round."""
    metrics = tuple((f"decoder-{i}", free_port()) for i in range(decoders))
    config = free_ports_config(
        model_dir=args.model_dir,
        num_decoders=decoders,
        embedding_model_dir="",
        log_dir=tempfile.mkdtemp(prefix=f"meshserve-engines-bench-{decoders}-"),
        metrics_ports=metrics,
        extra_env=(("MESHSERVE_COMPILE_MODEL", "true" if compiled else "false"),),
    )
    mesh = Mesh(config).start(timeout=900)
    asyncio.run(_load(mesh.gateway_url, Path(args.model_dir).name, args, -1))  # warm-up, not recorded
    return mesh, metrics


def _summary(mesh: Mesh, metrics: Sequence[tuple[str, int]], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    placement = {
        name: {"cpus": format_cpus(spec.cpus), "threads": spec.env.get("MESHSERVE_NUM_THREADS", "")}
        for name, spec in mesh.specs.items()
        if name.startswith("decoder-")
    }
    served = {
        name: metric_sample(port, "meshserve_worker_num_finished") for name, port in metrics
    }  # warm-up included
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "cpu_s"}
    return {"placement": placement, "requests_served": served, "rounds": rounds, "median": median}


def measure(args: argparse.Namespace, counts: Sequence[int], compiled: bool) -> dict[str, Any]:
    """Every mesh started at once and idle but for the one under load: rounds alternate
    between them, so drift in the shared host's background load falls on all alike."""
    meshes: dict[int, tuple[Mesh, tuple[tuple[str, int], ...]]] = {}
    try:
        for count in counts:
            meshes[count] = _start_mesh(args, count, compiled)
        rounds: dict[int, list[dict[str, Any]]] = {count: [] for count in counts}
        for r in range(args.rounds):
            for count, (mesh, _) in meshes.items():
                rounds[count].append(_round(mesh, args, r))
                print(f"round {r}, {count} decoder(s): {json.dumps(rounds[count][-1])}", flush=True)
        return {
            f"{count}_decoders": _summary(mesh, metrics, rounds[count])
            for count, (mesh, metrics) in meshes.items()
        }
    finally:
        for mesh, _ in meshes.values():
            mesh.stop()


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engines_bench", description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--decoders", default="1,2", help="decoder counts to measure, comma-separated")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forward", default="eager,compiled", help="forwards to measure, comma-separated")
    parser.add_argument("--out", default="bench/results/engines_bench.json")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.decoders.split(",")]
    results: dict[str, Any] = {}
    for forward in args.forward.split(","):
        results[forward] = measure(args, counts, compiled=forward == "compiled")
        if {"1_decoders", "2_decoders"} <= results[forward].keys():
            one, two = (results[forward][f"{n}_decoders"]["median"]["output_tok_s"] for n in (1, 2))
            results[forward]["output_tok_s_2_to_1"] = two / one
    report = {
        "command": "python -m bench.engines_bench " + " ".join(argv),
        "host": host_info(),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
