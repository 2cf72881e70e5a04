"""KV tiers under a multi-turn workload whose working set is several times the KV cache.

Conversations of token-id prompts: a private opening (``--opening`` tokens), then per turn
``--turn-tokens`` more (the previous answer and the next question); each turn's prompt is
the conversation so far. ``--conversations`` of them, turn by turn (every conversation's
first turn, then every second turn, ...), ``--concurrency`` in flight, on 2 decoders with a small KV cache (``--kv-cache-mb``): with the KV
tier off, with a tier of ``--tier-mb`` per decoder, and with that tier and the decoders
sharing prefixes (the scheduler's ``kv_share_min_tokens``, off in the first two). Per run: the prompt tokens
recomputed (the part of a prompt an earlier turn had computed that was not found cached),
the tokens found cached, TTFT p50/p99, and the decoders' tier counters.

Usage: ``python -m bench.kv_tier_bench [--model-dir DIR] [--out bench/results/kv_tier_bench.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.host import host_info
from bench.lora_bench import DEFAULT_MODEL
from bench.mesh_client import completion_body, engine_lines, metric_sample, model_name, sse_events
from launcher.mesh import Mesh, free_ports_config
from services.ports import free_port

TIER_METRICS = (
    "hit_tokens",
    "stored_blocks",
    "loaded_blocks",
    "evicted_blocks",
    "corrupt_blocks",
    "load_tokens_per_s",
)


def conversations(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn."""
    rng = random.Random(7)
    out = []
    for _ in range(args.conversations):
        history = [rng.randrange(10, vocab) for _ in range(args.opening)]
        turns = []
        for _ in range(args.turns):
            history = history + [rng.randrange(10, vocab) for _ in range(args.turn_tokens)]
            turns.append(history)
        out.append(turns)
    return out


async def _turn(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], tokens: int
) -> dict[str, Any]:
    start, first, usage = time.perf_counter(), None, {}
    async for event in sse_events(session, url, completion_body(model, prompt, tokens, "")):
        if event.get("usage"):
            usage = event["usage"]
        elif first is None and any(c.get("text") for c in event.get("choices", [])):
            first = time.perf_counter()
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"ttft_s": (first or time.perf_counter()) - start, "prompt": len(prompt), "cached": cached}


async def _workload(
    args: argparse.Namespace, url: str, model: str, convs: list[list[list[int]]]
) -> list[dict[str, Any]]:
    """Turn by turn: every conversation's turn k, ``concurrency`` at a time, then turn
    k + 1 (users come back after the others spoke: what a conversation computed is pushed
    out of the cache before its next turn)."""
    results: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(args.concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(turns: list[list[int]], k: int) -> None:
            async with gate:
                result = await _turn(session, url, model, turns[k], args.output_tokens)
            # Computed by the previous turn yet not found cached: recomputed.
            result["recomputed"] = max(0, (len(turns[k - 1]) if k else 0) - result["cached"])
            results.append(result)

        for k in range(args.turns):
            await asyncio.gather(*(one(turns, k) for turns in convs))
    return results


def _summary(results: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    ttfts = sorted(r["ttft_s"] for r in results)
    return {
        "requests": len(results),
        "seconds": seconds,
        "prompt_tokens": sum(r["prompt"] for r in results),
        "cached_tokens": sum(r["cached"] for r in results),
        "recomputed_tokens": sum(r["recomputed"] for r in results),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


def run(args: argparse.Namespace, tier_mb: int, share: int, convs: list[list[list[int]]]) -> dict[str, Any]:
    ports = {f"decoder-{i}": free_port() for i in range(2)}
    scheduler_port = free_port()
    config = free_ports_config(
        model_dir=args.model_dir,
        num_decoders=2,
        log_dir=tempfile.mkdtemp(prefix="meshserve-kv-tier-bench-"),
        metrics_ports=(*ports.items(), ("scheduler", scheduler_port)),
        extra_env=(
            ("MESHSERVE_KV_CACHE_MEMORY_MB", str(args.kv_cache_mb)),
            ("MESHSERVE_KV_TIER_MB", str(tier_mb)),
            ("MESHSERVE_KV_SHARE_MIN_TOKENS", str(share)),
        ),
    )
    mesh = Mesh(config).start(timeout=900)
    try:
        url, model = mesh.gateway_url + "/v1/completions", model_name(args.model_dir)
        started = time.perf_counter()
        results = asyncio.run(_workload(args, url, model, convs))
        out = _summary(results, time.perf_counter() - started)
        out["tier"] = {
            name: {
                **{m: metric_sample(port, f"meshserve_worker_kv_tier_{m}") for m in TIER_METRICS},
                # With load_tokens_per_s, what the scheduler counted a tier block for: 1 - prefill / load.
                "prefill_tokens_per_s": metric_sample(port, "meshserve_worker_prefill_tokens_per_s"),
            }
            for name, port in ports.items()
        }
        out["shares"] = {
            decision: metric_sample(scheduler_port, "meshserve_scheduler_kv_shares_total", decision=decision)
            for decision in ("shared", "pull_slower")
        }
        out["engines"] = engine_lines(mesh)
        return out
    finally:
        mesh.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.kv_tier_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--opening", type=int, default=200)
    p.add_argument("--turn-tokens", type=int, default=150)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kv-cache-mb", type=int, default=96)
    p.add_argument("--tier-mb", type=int, default=1024)
    p.add_argument("--share-min-tokens", type=int, default=256)
    p.add_argument("--out", default="bench/results/kv_tier_bench.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoConfig

    convs = conversations(args, int(AutoConfig.from_pretrained(args.model_dir).vocab_size))
    working_set = sum(len(turns[-1]) for turns in convs)
    runs = {
        "tier_off": run(args, 0, 0, convs),
        "local_tier": run(args, args.tier_mb, 0, convs),
        "local_tier_sharing": run(args, args.tier_mb, args.share_min_tokens, convs),
    }
    off, tier, shared = runs["tier_off"], runs["local_tier"], runs["local_tier_sharing"]
    report: dict[str, Any] = {
        "command": "python -m bench.kv_tier_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": host_info(),
        "model": model_name(args.model_dir),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "working_set_tokens": working_set,
        **runs,
        "recomputed_tokens_tier_over_off": tier["recomputed_tokens"] / max(1, off["recomputed_tokens"]),
        "ttft_p50_tier_over_off": tier["ttft_p50_ms"] / off["ttft_p50_ms"],
        "ttft_p99_tier_over_off": tier["ttft_p99_ms"] / off["ttft_p99_ms"],
        "recomputed_tokens_sharing_over_off": shared["recomputed_tokens"] / max(1, off["recomputed_tokens"]),
        "ttft_p50_sharing_over_off": shared["ttft_p50_ms"] / off["ttft_p50_ms"],
        "ttft_p99_sharing_over_off": shared["ttft_p99_ms"] / off["ttft_p99_ms"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("host",)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
