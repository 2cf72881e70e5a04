"""Multi-LoRA benchmark: what batching adapters costs, and what adapter-aware routing saves.

    python -m bench.lora_bench [--model-dir DIR] [--requests 256] [--concurrency 32]
        [--prompt-len 128] [--output-len 64] [--rank 16]
        [--routing-adapters 8] [--routing-max-loras 2] [--zipf 1.1] [--repeats 3]
        [--out bench/results/lora_bench.json]

Both parts run the real mesh (launcher.mesh: redis, scheduler, tokenizer, gateway,
decoder processes) and send token-id prompts to the gateway's `/v1/completions` (SSE), a
closed loop of `--concurrency` requests in flight; the adapters are random PEFT adapters
of rank `--rank` on every projection, built for the model at the start (peft).

1. Overhead: one decoder, `--concurrency` (32) in flight. Output tokens/s of base-model
   requests on a decoder without LoRA, then on a decoder with `--max-loras 4` and 4
   adapters: base-only requests, and a uniform mix of the 4 adapters. Overhead % =
   1 - mix / base (LoRA off).
2. Routing: 2 decoders (each on half of the CPUs, as the launcher places them),
   `--routing-adapters` (8) adapters loaded on both, `--routing-max-loras` (2) slots each,
   each request's adapter drawn from a Zipf(`--zipf`) law over them (same seeded sequence
   for every policy). The scheduler's `prefix` policy (adapter residency
   weighed with load) against `round_robin`: adapter loads into slots per 1,000 requests
   (the decoders' `meshserve_worker_lora_loads`), TTFT p50/p99 and output tokens/s.

Every configuration runs `--repeats` rounds in its mesh (fresh prompts each round, and in
part 2 a fresh adapter sequence, the same for both policies); each figure is the median of
its rounds, which the JSON also keeps. The JSON (`--out`) records the command, the commit,
the CPU model and every number. Timings need an otherwise idle machine.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.host import host_info
from bench.mesh_client import engine_lines, free_ports_config, metric_sample, sse_events
from launcher.mesh import Mesh
from services.ports import free_port

DEFAULT_MODEL = Path(".cache/models/smollm2-135m-instruct")
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Result:
    """One request as the client saw it."""

    ttft_s: float
    latency_s: float
    output_tokens: int


def build_adapters(model_dir: str, root: Path, count: int, rank: int) -> dict[str, str]:
    """`count` random PEFT adapters (non-zero A and B) for `model_dir`; name -> directory."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i in range(count):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(root / f"lora-{i}")
        out[f"lora-{i}"] = str(root / f"lora-{i}")
    return out


@contextmanager
def mesh(model_dir: str, decoders: int, policy: str, **lora: Any) -> Iterator[tuple[Mesh, list[int]]]:
    """The mesh with `decoders` decoders (metrics ports returned) and the LoRA options `lora`."""
    ports = [free_port() for _ in range(decoders)]
    config = free_ports_config(
        model_dir=model_dir,
        num_decoders=decoders,
        embedding_model_dir="",
        routing_policy=policy,
        log_dir=tempfile.mkdtemp(prefix="meshserve-lora-bench-"),
        metrics_ports=tuple((f"decoder-{i}", port) for i, port in enumerate(ports)),
        **lora,
    )
    started = Mesh(config).start(timeout=600)  # several decoders: the launcher shares the CPUs
    try:
        yield started, ports
    finally:
        started.stop()


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    extra: dict[str, Any] | None = None,
    arrivals: list[float] | None = None,
) -> Result:
    """One streamed greedy completion of ``output_len`` tokens (``extra``: more body fields;
    ``arrivals``: gets the `time.monotonic()` of each chunk with text, a token each)."""
    body = {
        **(extra or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    async for event in sse_events(session, url, body):
        if event.get("usage"):
            tokens = int(event["usage"]["completion_tokens"])
        elif any(c.get("text") for c in event.get("choices", [])):
            if arrivals is not None:
                arrivals.append(time.monotonic())
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return Result((first or end) - start, end - start, tokens)


async def closed_loop(
    base_url: str, models: Sequence[str], prompts: Sequence[list[int]], concurrency: int, output_len: int
) -> tuple[list[Result], float]:
    """Request i with `models[i]` and `prompts[i]`, `concurrency` in flight; (results, seconds)."""
    queue = list(range(len(models)))
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                results.append(
                    await one_request(
                        session, base_url + "/v1/completions", models[i], prompts[i], output_len
                    )
                )

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def summary(results: Sequence[Result], seconds: float) -> dict[str, float]:
    ttfts = sorted(r.ttft_s for r in results)
    return {
        "requests": len(results),
        "output_tok_s": sum(r.output_tokens for r in results) / seconds,
        "requests_s": len(results) / seconds,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "latency_p50_ms": 1000 * statistics.median(r.latency_s for r in results),
    }


def medians(rounds: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Each figure's median over the rounds, and the rounds themselves."""
    return {**{k: statistics.median(r[k] for r in rounds) for k in rounds[0]}, "rounds": list(rounds)}


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def zipf_choices(names: Sequence[str], n: int, s: float, seed: int) -> list[str]:
    """`n` draws from `names` with P(rank k) ~ 1 / k^s (seeded: the same for every policy)."""
    weights = [1 / (k + 1) ** s for k in range(len(names))]
    return random.Random(seed).choices(list(names), weights=weights, k=n)


def run_overhead(args: argparse.Namespace, adapters: dict[str, str], base: str, vocab: int) -> dict[str, Any]:
    n, c = args.requests, args.concurrency
    four = list(adapters)[:4]
    mix = [four[i % 4] for i in range(n)]
    # Fresh prompts each round: no round finds the previous one's in the prefix cache.
    prompts = [prompts_for(n, args.prompt_len, vocab, seed=1 + 10 * r) for r in range(args.repeats)]

    def loop(url: str, models: list[str], r: int) -> dict[str, float]:
        return summary(*asyncio.run(closed_loop(url, models, prompts[r], c, args.output_len)))

    engines = {}  # each mesh's engine start-up lines: their effective configuration
    with mesh(args.model_dir, 1, "prefix") as (m, _):
        engines["lora_off"] = engine_lines(m)
        off = [loop(m.gateway_url, [base] * n, r) for r in range(args.repeats)]
    modules = ",".join(f"{k}={adapters[k]}" for k in four)
    lora = {"lora_modules": modules, "max_loras": 4, "max_lora_rank": args.rank}
    on: list[dict[str, float]] = []
    mixed: list[dict[str, float]] = []
    with mesh(args.model_dir, 1, "prefix", **lora) as (m, _):
        engines["lora_on"] = engine_lines(m)
        for r in range(args.repeats):  # base and mix alternate, round by round
            on.append(loop(m.gateway_url, [base] * n, r))
            mixed.append(loop(m.gateway_url, mix, r))
    out: dict[str, Any] = {
        "engines": engines,
        "base_lora_off": medians(off),
        "base_lora_on": medians(on),
        "mix_4_adapters": medians(mixed),
    }
    out["overhead_pct"] = 100 * (
        1 - out["mix_4_adapters"]["output_tok_s"] / out["base_lora_off"]["output_tok_s"]
    )
    out["overhead_lora_on_base_pct"] = 100 * (
        1 - out["base_lora_on"]["output_tok_s"] / out["base_lora_off"]["output_tok_s"]
    )
    return out


def run_routing(args: argparse.Namespace, adapters: dict[str, str], vocab: int) -> dict[str, Any]:
    names = list(adapters)[: args.routing_adapters]
    n = args.requests
    # Each round its own seeded adapter sequence and prompts, the same for every policy.
    models = [zipf_choices(names, n, args.zipf, seed=2 + 10 * r) for r in range(args.repeats)]
    prompts = [prompts_for(n, args.prompt_len, vocab, seed=3 + 10 * r) for r in range(args.repeats)]
    modules = ",".join(f"{k}={adapters[k]}" for k in names)
    out: dict[str, Any] = {"adapter_counts": [{k: m.count(k) for k in names} for m in models]}
    for policy in ("prefix", "round_robin"):
        lora = {"lora_modules": modules, "max_loras": args.routing_max_loras, "max_lora_rank": args.rank}
        rounds = []
        with mesh(args.model_dir, 2, policy, max_cpu_loras=len(names), **lora) as (m, ports):
            out.setdefault("engines", {})[policy] = engine_lines(m)
            for r in range(args.repeats):
                before = sum(metric_sample(p, "meshserve_worker_lora_loads") for p in ports)
                results, seconds = asyncio.run(
                    closed_loop(m.gateway_url, models[r], prompts[r], args.concurrency, args.output_len)
                )
                time.sleep(1.5)  # the gauges refresh every second
                loads = sum(metric_sample(p, "meshserve_worker_lora_loads") for p in ports) - before
                rounds.append({**summary(results, seconds), "adapter_loads_per_1000": 1000 * loads / n})
        out[policy] = medians(rounds)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.lora_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--routing-adapters", type=int, default=8)
    p.add_argument("--routing-max-loras", type=int, default=2)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--repeats", type=int, default=3, help="rounds per configuration (medians reported)")
    p.add_argument("--parts", default="overhead,routing", help="comma-separated: overhead, routing")
    p.add_argument("--out", default="bench/results/lora_bench.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(args.model_dir).vocab_size)
    base = Path(args.model_dir).name
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {
        "command": "python -m bench.lora_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": host_info(),
        "model": base,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }
    with tempfile.TemporaryDirectory(prefix="lora-bench-adapters-") as root:
        adapters = build_adapters(args.model_dir, Path(root), max(4, args.routing_adapters), args.rank)
        if "overhead" in parts:
            report["overhead"] = run_overhead(args, adapters, base, vocab)
            print(json.dumps(report["overhead"], indent=1), flush=True)
        if "routing" in parts:
            report["routing"] = run_routing(args, adapters, vocab)
            print(json.dumps(report["routing"], indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
