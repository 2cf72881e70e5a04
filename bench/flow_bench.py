"""Flow control under a flood: what one tenant's traffic does to another's.

One mesh on `make serve`'s defaults (its default model and priority classes), five API
keys. Requests name their class in ``service_tier`` and carry the class' vLLM ``priority``
too, so that a mesh from before classes (``--phases`` of the first three) runs the same
load. Phases, each its own figures:

- ``alone``: the interactive tenant at c=2 (class ``interactive``);
- ``beside_flood``: the same beside a batch tenant flooding at c=64 (class ``batch``),
  and the flood's output tokens/s meanwhile (what priority costs it);
- ``beside_flood_same_priority``: the same with the interactive requests in class
  ``batch``, the reference for what priority buys;
- ``sheddable``: beside the flood, requests of class ``sheddable`` at c=2: refused with 429
  at once (the time to the refusal), never queued;
- ``two_tenants``: two equal tenants flooding together at c=32 each for a fixed time:
  the share of the output tokens each got;
- ``over_budget``: a tenant with a token budget of a few requests a minute sending at
  c=4: answered, refused with 429 (and ``Retry-After``), and failed otherwise
  (time-outs and other errors; the target is none).

Each flooding tenant's client runs in a process of its own, as another tenant's client
would: the interactive tenant's times are not spent waiting in the flood's event loop.

Usage: ``python -m bench.flow_bench [--model-dir DIR] [--priority-step-ratio R] [--rounds N]
[--out bench/results/flow_bench.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.host import host_info
from bench.lora_bench import DEFAULT_MODEL, Result, one_request, prompts_for, summary
from bench.mesh_client import engine_lines, median_of, model_name
from launcher.mesh import Mesh, free_ports_config

KEYS = ("interactive", "batch", "tenant-a", "tenant-b", "capped")
TIMEOUT = aiohttp.ClientTimeout(total=600)


def _session(key: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=TIMEOUT, headers={"Authorization": f"Bearer {key}"})


# The default classes' vLLM priorities (gateway/config.py `classes`).
PRIORITY = {"interactive": -10, "default": 0, "batch": 10, "sheddable": 20}
PHASES = ("alone", "beside_flood", "beside_flood_same_priority", "sheddable", "two_tenants", "over_budget")


def _tier(name: str) -> dict[str, Any]:
    return {"service_tier": name, "priority": PRIORITY[name]}


async def _closed_loop(
    url: str, key: str, model: str, prompts: list[list[int]], c: int, output_len: int, tier: str
) -> tuple[list[Result], float]:
    """Every prompt once, ``c`` in flight, as tenant ``key``; (results, seconds)."""
    queue = list(prompts)
    results: list[Result] = []
    async with _session(key) as session:

        async def worker() -> None:
            while queue:
                prompt = queue.pop()
                results.append(await one_request(session, url, model, prompt, output_len, _tier(tier)))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
    return results, time.perf_counter() - start


async def _flood(
    url: str, key: str, model: str, prompts: list[list[int]], c: int, output_len: int, *, stop: asyncio.Event
) -> tuple[list[Result], list[float]]:
    """Tenant ``key`` keeps ``c`` requests in flight until ``stop`` (class batch); its
    finished requests, and when each of its tokens arrived (one streamed chunk a token)."""
    results: list[Result] = []
    arrivals: list[float] = []
    async with _session(key) as session:

        async def worker(i: int) -> None:
            n = i
            while not stop.is_set():
                prompt = prompts[n % len(prompts)]
                results.append(
                    await one_request(session, url, model, prompt, output_len, _tier("batch"), arrivals)
                )
                n += c

        tasks = [asyncio.create_task(worker(i)) for i in range(c)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results, arrivals


class FloodProcess:
    """A tenant's flood (`_flood`) in a client process of its own, as another tenant's
    client would be: the interactive requests' times are not spent in the flood's event
    loop. ``stop`` ends it and returns what `_flood` returns."""

    def __init__(self, *flood_args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._out: Any = ctx.Queue()
        self._proc = ctx.Process(target=_flood_main, args=(flood_args, self._stop, self._out), daemon=True)
        self._proc.start()

    async def stop(self) -> tuple[list[Result], list[float]]:
        self._stop.set()
        results, arrivals = await asyncio.to_thread(self._out.get, True, 120)
        await asyncio.to_thread(self._proc.join, 30)
        return [Result(*r) for r in results], arrivals


def _flood_main(flood_args: tuple[Any, ...], stop: Any, out: Any) -> None:
    async def main() -> tuple[list[Result], list[float]]:
        stopped = asyncio.Event()
        flood = asyncio.create_task(_flood(*flood_args, stop=stopped))
        await asyncio.to_thread(stop.wait)
        stopped.set()
        return await flood

    results, arrivals = asyncio.run(main())
    out.put(([dataclasses.astuple(r) for r in results], arrivals))


async def _beside_flood(
    args: argparse.Namespace, url: str, model: str, vocab: int, tier: str
) -> dict[str, Any]:
    seed = PRIORITY[tier] + args.seed_offset  # fresh prompts every round: no prefix cache hits
    flood_prompts = prompts_for(4 * args.flood_c, args.prompt_len, vocab, seed=7 + seed)
    flood = FloodProcess(url, "batch", model, flood_prompts, args.flood_c, args.flood_output_len)
    await asyncio.sleep(args.settle_s)  # the flood fills the batch first
    prompts = prompts_for(args.interactive_requests, args.prompt_len, vocab, seed=11 + seed)
    began = time.monotonic()
    if tier == "sheddable":
        figures = await _shed(url, model, prompts, args.output_len)
    else:
        results, seconds = await _closed_loop(url, "interactive", model, prompts, 2, args.output_len, tier)
        figures = {"interactive": summary(results, seconds)}
    ended = time.monotonic()
    flooded, arrivals = await flood.stop()
    meanwhile = sum(1 for t in arrivals if began <= t <= ended)
    return {
        **figures,
        "flood_requests_done": len(flooded),
        # The flood's tokens that arrived while the interactive requests ran, per second.
        "flood_output_tok_s_meanwhile": meanwhile / (ended - began),
    }


async def _shed(url: str, model: str, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Each prompt once as class sheddable, c=2: answered, refused (429) and the time to
    each refusal."""
    counts = {"answered": 0, "refused_429": 0, "failed": 0}
    refusal_ms: list[float] = []
    queue = list(prompts)
    async with _session("interactive") as session:

        async def worker() -> None:
            while queue:
                body = {**_tier("sheddable"), "model": model, "prompt": queue.pop(), "max_tokens": output_len}
                start = time.perf_counter()
                async with session.post(url, json=body) as reply:
                    await reply.read()
                if reply.status == 429:
                    counts["refused_429"] += 1
                    refusal_ms.append(1000 * (time.perf_counter() - start))
                else:
                    counts["answered" if reply.status == 200 else "failed"] += 1

        await asyncio.gather(worker(), worker())
    refusal_ms.sort()
    return {**counts, "refusal_ms_p50": refusal_ms[len(refusal_ms) // 2] if refusal_ms else None}


async def _two_tenants(args: argparse.Namespace, url: str, model: str, vocab: int) -> dict[str, Any]:
    floods = [
        FloodProcess(
            url, key, model, prompts_for(64, args.prompt_len, vocab, seed=20 + i), 32, args.output_len
        )
        for i, key in enumerate(("tenant-a", "tenant-b"))
    ]
    await asyncio.sleep(args.fair_s)
    a, b = [sum(r.output_tokens for r in (await f.stop())[0]) for f in floods]
    return {"tenant_a_tokens": a, "tenant_b_tokens": b, "tenant_a_share": a / max(1, a + b)}


async def _over_budget(args: argparse.Namespace, url: str, model: str, vocab: int) -> dict[str, Any]:
    counts = {"answered": 0, "refused_429": 0, "failed": 0}
    retry_after: list[int] = []
    body_prompts = prompts_for(64, args.prompt_len, vocab, seed=30)
    deadline = time.monotonic() + args.budget_s
    async with _session("capped") as session:

        async def worker(i: int) -> None:
            n = i
            while time.monotonic() < deadline:
                body = {"model": model, "prompt": body_prompts[n % 64], "max_tokens": args.output_len}
                body |= _tier("default")
                n += 4
                try:
                    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as reply:
                        await reply.read()
                        if reply.status == 200:
                            counts["answered"] += 1
                        elif reply.status == 429:
                            counts["refused_429"] += 1
                            retry_after.append(int(reply.headers.get("Retry-After", "0")))
                            await asyncio.sleep(0.2)
                        else:
                            counts["failed"] += 1
                except (aiohttp.ClientError, TimeoutError):
                    counts["failed"] += 1

        await asyncio.gather(*(worker(i) for i in range(4)))
    return {**counts, "retry_after_s_max": max(retry_after, default=0)}


def _engine_env(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The decoder settings the bench varies (none given: `make serve`'s defaults)."""
    if args.priority_step_ratio is None:
        return ()
    return (("MESHSERVE_PRIORITY_STEP_RATIO", str(args.priority_step_ratio)),)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(args.model_dir).vocab_size)
    budget = args.capped_tokens_per_minute
    config = free_ports_config(
        model_dir=args.model_dir,
        api_keys=",".join(KEYS),
        log_dir=tempfile.mkdtemp(prefix="meshserve-flow-bench-"),
        extra_env=(("MESHSERVE_KEY_BUDGETS", f"capped={budget}/0"), *_engine_env(args)),
    )
    mesh = Mesh(config).start(timeout=900)
    try:
        url, model = mesh.gateway_url + "/v1/completions", model_name(args.model_dir)
        out: dict[str, Any] = {"engines": engine_lines(mesh)}
        warm = prompts_for(8, args.prompt_len, vocab, seed=4)
        asyncio.run(_closed_loop(url, "interactive", model, warm, 4, args.output_len, "default"))

        def alone() -> dict[str, Any]:
            prompts = prompts_for(
                args.interactive_requests, args.prompt_len, vocab, seed=3 + args.seed_offset
            )
            return summary(
                *asyncio.run(
                    _closed_loop(url, "interactive", model, prompts, 2, args.output_len, "interactive")
                )
            )

        phases = {
            "alone": alone,
            "beside_flood": lambda: asyncio.run(_beside_flood(args, url, model, vocab, "interactive")),
            "beside_flood_same_priority": lambda: asyncio.run(
                _beside_flood(args, url, model, vocab, "batch")
            ),
            "sheddable": lambda: asyncio.run(_beside_flood(args, url, model, vocab, "sheddable")),
            "two_tenants": lambda: asyncio.run(_two_tenants(args, url, model, vocab)),
            "over_budget": lambda: asyncio.run(_over_budget(args, url, model, vocab)),
        }
        rounds: list[dict[str, Any]] = []
        for index in range(args.rounds):
            args.seed_offset = 1000 * index
            rounds.append({name: phases[name]() for name in args.phases.split(",")})
        out.update(median_of(rounds))
        if args.rounds > 1:
            out["rounds"] = rounds
        alone = out["alone"]["ttft_p99_ms"]
        for name, key in (("beside_flood", "interactive"), ("beside_flood_same_priority", "same_priority")):
            if name in out:
                out[f"{key}_ttft_p99_beside_flood_over_alone"] = (
                    out[name]["interactive"]["ttft_p99_ms"] / alone
                )
        return out
    finally:
        mesh.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.flow_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--flood-c", type=int, default=64)
    p.add_argument("--flood-output-len", type=int, default=128)
    p.add_argument("--interactive-requests", type=int, default=24)
    p.add_argument("--settle-s", type=float, default=5.0, help="flood alone before the interactive requests")
    p.add_argument("--fair-s", type=float, default=30.0, help="how long the two tenants flood together")
    p.add_argument("--budget-s", type=float, default=15.0, help="how long the capped tenant sends")
    p.add_argument("--capped-tokens-per-minute", type=int, default=600)
    p.add_argument("--phases", default=",".join(PHASES), help="which phases, in this order (alone first)")
    p.add_argument(
        "--priority-step-ratio", type=float, default=None, help="the decoder's (default: its own default)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="the phases this many times, in order (medians reported; per round in `rounds`)",
    )
    p.add_argument("--out", default="bench/results/flow_bench.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report: dict[str, Any] = {
        "command": "python -m bench.flow_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": host_info(),
        "model": model_name(args.model_dir),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        **run(args),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
