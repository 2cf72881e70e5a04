"""Scheduler CPU per request: the full mesh under an open-loop stream of short requests.

    python -m bench.scheduler_cost --model-dir DIR [--rate 100 --duration 20
        --prompt-len 32 --max-tokens 2 --num-decoders 1 --repeats 3]
        --out bench/results/scheduler_cost.json

Requests arrive at `--rate` per second (Poisson, open loop: a slow mesh does not slow the
arrivals), each a streamed completion of a random `--prompt-len`-token prompt and
`--max-tokens` output tokens. The scheduler's whole process CPU (Route and Release, the
heartbeats, the KV-event subscriber, housekeeping) is read from /proc before and after
each run and divided by the requests served: what one request costs the scheduler at
that rate. Also reported: the rate achieved, errors, end-to-end latency percentiles and
the other processes' CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx

from bench.mesh_client import model_name, running_mesh
from bench.mesh_overhead import cpu_by_service
from bench.report import save


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    async with client.stream("POST", url, json=body) as reply:
        reply.raise_for_status()
        async for _ in reply.aiter_lines():
            pass
    return time.perf_counter() - start


async def _open_loop(args: argparse.Namespace, gateway_url: str, model: str, salt: str) -> dict[str, Any]:
    rng = random.Random(salt)
    latencies: list[float] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=512)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def request(i: int) -> None:
            body = {
                "model": model,
                "prompt": [rng.randrange(10, 3000) for _ in range(args.prompt_len)],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "cache_salt": f"{salt}-{i}",
            }
            try:
                latencies.append(await _one(client, gateway_url + "/v1/completions", body))
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)

        tasks = []
        start = time.perf_counter()
        next_at = start
        i = 0
        while next_at - start < args.duration:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(request(i)))
            i += 1
            next_at += rng.expovariate(args.rate)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "sent": i,
        "served": len(latencies),
        "errors": len(errors),
        "achieved_rate": len(latencies) / elapsed,
        "latency_ms": {
            "p50": 1000 * latencies[len(latencies) // 2] if latencies else None,
            "p99": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else None,
        },
    }


async def _runs(args: argparse.Namespace, mesh: Any) -> list[dict[str, Any]]:
    model = model_name(args.model_dir)
    await _open_loop(argparse.Namespace(**{**vars(args), "duration": 2.0}), mesh.gateway_url, model, "warm")
    rows = []
    for repeat in range(args.repeats):
        before = cpu_by_service(mesh)
        row = await _open_loop(args, mesh.gateway_url, model, f"r{repeat}")
        after = cpu_by_service(mesh)
        per_request = {
            name: round(1000 * (after[name] - before.get(name, 0.0)) / max(row["served"], 1), 3)
            for name in after
        }
        row["cpu_ms_per_request"] = per_request
        row["scheduler_cpu_ms_per_request"] = sum(
            v for k, v in per_request.items() if k.startswith("scheduler")
        )
        print(
            f"repeat {repeat}: {row['achieved_rate']:.1f} req/s served, {row['errors']} errors, scheduler "
            f"{row['scheduler_cpu_ms_per_request']:.3f} ms CPU/request, p50 {row['latency_ms']['p50']:.0f} ms",
            flush=True,
        )
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Starts the mesh, runs the repeats, returns the report."""
    with running_mesh(args.model_dir, 256, 2048, num_decoders=args.num_decoders) as mesh:
        rows = asyncio.run(_runs(args, mesh))
    return {
        "workload": {
            "rate": args.rate,
            "duration_s": args.duration,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "num_decoders": args.num_decoders,
            "repeats": args.repeats,
        },
        "summary": {
            "scheduler_cpu_ms_per_request_median": statistics.median(
                r["scheduler_cpu_ms_per_request"] for r in rows
            ),
            "achieved_rate_median": statistics.median(r["achieved_rate"] for r in rows),
            "errors_total": sum(r["errors"] for r in rows),
        },
        "runs": rows,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=".cache/models/smollm2-135m-instruct")
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per repeat")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--num-decoders", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/scheduler_cost.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    report = save("bench.scheduler_cost", argv, run(args), args.out)
    print(json.dumps(report["summary"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
