"""P/D disaggregation benchmark: 1 prefill + 1 decode worker vs 2 colocated decoders, the
same two cores both ways, under short streaming chats while long prompts keep arriving,
at three loads.

    python -m bench.pd_bench [--model-dir DIR] [--loads light,medium,saturating]
        [--rounds 2 --duration-s 40] [--chat-prompt 64 --chat-tokens 64]
        [--long-prompt 2000 --long-tokens 8] [--pd-min-prompt-tokens 512]
        [--pd-decision estimate] [--out bench/results/pd_bench.json]

Modes, each a mesh (launcher.mesh.Mesh: Redis, gateway, tokenizer, scheduler, two engine
workers, the forward compiled as `make serve` runs it), both up at once, idle but for the
one under load: rounds alternate between them so the shared host's drift falls on both.

* ``pd``: ``decoder-0`` + ``prefill-0`` (``--num-prefill 1``); short prompts run whole on
  either (the scheduler's ``pd_prefill_decodes``); a long prompt runs whole on the prefill
  worker when it computes it soonest, else on the decoder, where the scheduler decides
  whether the prefill worker prefills it (``--pd-decision``: ``estimate``, the default,
  only when the hand-off is expected to beat a local prefill; ``threshold``: every prompt
  with at least ``--pd-min-prompt-tokens`` uncached tokens);
* ``colocated``: ``decoder-0`` + ``decoder-1``, each prefilling its own prompts.

The launcher places the two workers as it does for users: each on half of the CPUs this
process may use, with as many torch threads (services.cpus). The gateway, tokenizer,
scheduler and this client are not pinned.

Workload per round (``--duration-s``), at each load of ``LOADS`` (chats, seconds between
long prompts): that many closed-loop clients each send short streaming completions
(``--chat-prompt`` random token ids, ``--chat-tokens`` output) back to back; meanwhile
one long prompt (``--long-prompt`` random token ids, ``--long-tokens`` output) starts
every so many seconds. Every prompt is fresh random ids with a round-unique cache salt,
so no prefix cache helps either mode. Before its first round each mesh serves two long
prompts and a chat, not measured (`warm_up`). Reported per load, mode and round: the
chats' TTFT, inter-token latency (gap between streamed chunks) and end-to-end latency
(sent to last chunk) p50/p99, the long
prompts' TTFT p50/p99 and each one's send time and TTFT (``longs``), output tokens/s,
requests completed and failed, and the round's wall time; then the median of the rounds,
decoder-0's hand-offs by outcome and the scheduler's P/D decisions. The JSON (``--out``)
records the command, the host and commit, and each worker's engine start-up line (its
effective configuration).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.host import host_info
from bench.mesh_client import completion_body, engine_lines, free_ports_config, median_of
from launcher.mesh import Mesh
from services.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "pd_bench.json"
DEFAULT_MODEL = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
MODES = ("pd", "colocated")
# Load name -> (closed-loop chat clients, seconds between long prompts).
LOADS = {"light": (2, 8.0), "medium": (8, 4.0), "saturating": (16, 2.0)}


@dataclass(frozen=True)
class BenchConfig:
    model_dir: str
    loads: str = ",".join(LOADS)
    rounds: int = 2
    duration_s: float = 40.0
    chats: int = 8  # set per load (LOADS)
    chat_prompt: int = 64
    chat_tokens: int = 64
    long_prompt: int = 2000
    long_every_s: float = 4.0  # set per load (LOADS)
    long_tokens: int = 8
    pd_min_prompt_tokens: int = 512
    pd_decision: str = "estimate"
    max_num_batched_tokens: int = 512
    kv_cache_memory_mb: int = 512


@dataclass
class Result:
    """One request: TTFT, the gaps between its streamed chunks (per token), its tokens."""

    kind: str  # "chat" | "long"
    ttft: float
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    sent_s: float = 0.0  # when it was sent, seconds into its round


def start_mesh(config: BenchConfig, mode: str) -> Mesh:
    workers = {"pd": (1, 1), "colocated": (2, 0), "single": (1, 0)}[mode]
    mesh_config = free_ports_config(
        model_dir=config.model_dir,
        num_decoders=workers[0],
        num_prefill=workers[1],
        embedding_model_dir="",
        kv_cache_memory_mb=config.kv_cache_memory_mb,
        log_dir=tempfile.mkdtemp(prefix=f"meshserve-pd-bench-{mode}-"),
        metrics_ports=(("decoder-0", free_port()), ("scheduler", free_port())),
        extra_env=(
            ("MESHSERVE_MAX_NUM_BATCHED_TOKENS", str(config.max_num_batched_tokens)),
            ("MESHSERVE_PD_MIN_PROMPT_TOKENS", str(config.pd_min_prompt_tokens)),
            ("MESHSERVE_PD_DECISION", config.pd_decision),
        ),
    )
    return Mesh(mesh_config).start(timeout=300)


async def wait_workers(base_url: str, mode: str, timeout: float = 120.0) -> None:
    """Until the gateway is healthy (for P/D, one heartbeat more: the prefill worker
    registers on its own schedule)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(base_url + "/health")).status_code == 200:
                    await asyncio.sleep(2.0 if mode == "pd" else 0.0)  # prefill worker's heartbeat
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError("gateway not healthy")


async def stream(client: httpx.AsyncClient, base_url: str, body: dict[str, Any], kind: str) -> Result:
    start = time.perf_counter()
    last = start
    result: Result | None = None
    async with client.stream("POST", base_url + "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage") and result is not None:
                result.tokens = event["usage"]["completion_tokens"]
            if not any(c.get("text") for c in event.get("choices", [])):
                continue
            now = time.perf_counter()
            if result is None:
                result = Result(kind, now - start)
            else:
                result.itls.append(now - last)
            last = now
    if result is None:
        raise RuntimeError("stream ended without output")
    return result


async def run_round(config: BenchConfig, base_url: str, model: str, vocab: int, salt: str) -> dict[str, Any]:
    rng = random.Random(salt)
    results: list[Result] = []
    failed = 0
    stop_at = time.monotonic() + config.duration_s
    started = time.perf_counter()

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    async def send(kind: str, n: int, out: int) -> None:
        nonlocal failed
        sent_s = time.perf_counter() - started
        try:
            result = await stream(client, base_url, completion_body(model, prompt(n), out, salt), kind)
        except (httpx.HTTPError, RuntimeError):
            failed += 1
            return
        result.sent_s = sent_s
        results.append(result)

    async def chat_loop() -> None:
        while time.monotonic() < stop_at:
            await send("chat", config.chat_prompt, config.chat_tokens)

    async def long_arrivals() -> None:
        pending = []
        while time.monotonic() < stop_at:
            pending.append(asyncio.create_task(send("long", config.long_prompt, config.long_tokens)))
            await asyncio.sleep(config.long_every_s)
        await asyncio.gather(*pending)

    limits = httpx.Limits(max_connections=config.chats + 64)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        await asyncio.gather(long_arrivals(), *(chat_loop() for _ in range(config.chats)))
        elapsed = time.perf_counter() - started
    return summarize(results, failed, elapsed)


async def warm_up(config: BenchConfig, base_url: str, model: str, vocab: int) -> None:
    """Two long prompts and a chat at once, not measured: a mesh's first requests find no
    measured rate (the P/D rule falls back to its threshold) and first-use costs that a
    running deployment has long paid."""
    salt = f"warm-up-{time.time()}"
    rng = random.Random(salt)
    async with httpx.AsyncClient(timeout=600.0) as client:
        sizes = ((config.long_prompt, config.long_tokens),) * 2 + ((config.chat_prompt, config.chat_tokens),)
        await asyncio.gather(
            *(
                stream(
                    client,
                    base_url,
                    completion_body(model, [rng.randrange(10, vocab) for _ in range(n)], out, salt),
                    "warm",
                )
                for n, out in sizes
            )
        )


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def summarize(results: list[Result], failed: int, elapsed: float) -> dict[str, Any]:
    chats = [r for r in results if r.kind == "chat"]
    longs = [r for r in results if r.kind == "long"]
    itls = [gap for r in chats for gap in r.itls]
    e2els = [r.ttft + sum(r.itls) for r in chats]
    return {
        "chat_ttft_ms": {"p50": pct([r.ttft for r in chats], 0.5), "p99": pct([r.ttft for r in chats], 0.99)},
        "chat_itl_ms": {"p50": pct(itls, 0.5), "p99": pct(itls, 0.99)},
        # Sent to last chunk (vllm bench serve's E2EL): a stream that stalls for seconds
        # behind another prompt's prefill shows here, where its few long gaps may all lie
        # above the ITL p99.
        "chat_e2el_ms": {"p50": pct(e2els, 0.5), "p99": pct(e2els, 0.99)},
        "long_ttft_ms": {"p50": pct([r.ttft for r in longs], 0.5), "p99": pct([r.ttft for r in longs], 0.99)},
        # Each long prompt's [sent at (s into the round), TTFT (ms)]: which ones set the p99.
        "longs": sorted([round(r.sent_s, 2), round(r.ttft * 1000)] for r in longs),
        "output_tok_s": sum(r.tokens for r in results) / elapsed,
        "completed": {"chat": len(chats), "long": len(longs)},
        "failed": failed,
        "seconds": elapsed,
    }


def vocab_size(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config", config)
    return int(text["vocab_size"])


def run_loads(config: BenchConfig) -> dict[str, Any]:
    """Both meshes up; per load, rounds alternating between the modes."""
    meshes: dict[str, Mesh] = {}
    try:
        model = Path(config.model_dir).name
        vocab = vocab_size(config.model_dir)
        for mode in MODES:
            meshes[mode] = start_mesh(config, mode)
            asyncio.run(wait_workers(meshes[mode].gateway_url, mode))
            asyncio.run(warm_up(config, meshes[mode].gateway_url, model, vocab))
        results: dict[str, Any] = {"engines": {mode: engine_lines(mesh) for mode, mesh in meshes.items()}}
        for load in config.loads.split(","):
            chats, every = LOADS[load]
            loaded = dataclasses.replace(config, chats=chats, long_every_s=every)
            before = {mode: counters(mesh) for mode, mesh in meshes.items()}
            rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            for i in range(config.rounds):
                for mode, mesh in meshes.items():
                    salt = f"{load}-{mode}-{i}-{time.time()}"
                    summary = asyncio.run(run_round(loaded, mesh.gateway_url, model, vocab, salt))
                    print(f"{load} {mode} round {i}: {json.dumps(summary)}", flush=True)
                    rounds[mode].append(summary)
            results[load] = {
                mode: {
                    "rounds": rounds[mode],
                    "median": median_of(rounds[mode]),
                    "counters": difference(counters(mesh), before[mode]),
                }
                for mode, mesh in meshes.items()
            }
        return results
    finally:
        for mesh in meshes.values():
            mesh.stop()


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def counters(mesh: Mesh) -> dict[str, float]:
    """decoder-0's hand-offs by outcome and fallbacks by reason, and the scheduler's P/D
    decisions (`decision_*`)."""
    out = transfers(mesh)
    port = mesh.specs["scheduler"].env["MESHSERVE_METRICS_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        if family.name == "meshserve_scheduler_pd_decisions":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out["decision_" + sample.labels["decision"]] = sample.value
    return out


def transfers(mesh: Mesh) -> dict[str, float]:
    """decoder-0's hand-offs by outcome, fallbacks by reason (P/D took place or not), the
    seconds of its hand-offs' phases (prefill call, pull: sum and count) and how many took
    at most 1x and 2x their estimate (`estimate_ratio_1.0`, `_2.0`, of `_count`)."""
    port = mesh.specs["decoder-0"].env["MESHSERVE_METRICS_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("meshserve_worker_kv_transfers", "meshserve_worker_kv_transfer_fallbacks"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    label = sample.labels.get("outcome") or "fallback_" + sample.labels.get("reason", "")
                    out[label] = sample.value
        if family.name == "meshserve_worker_kv_transfer_seconds":  # seconds per phase: sum, count
            for sample in family.samples:
                for suffix in ("sum", "count"):
                    if sample.name.endswith("_" + suffix):
                        out[f"{sample.labels['phase']}_seconds_{suffix}"] = sample.value
        if family.name == "meshserve_worker_kv_handoff_estimate_ratio":  # took / estimated
            for sample in family.samples:
                if sample.name.endswith("_count") or sample.labels.get("le") in ("1.0", "2.0"):
                    out["estimate_ratio_" + sample.labels.get("le", "count")] = sample.value
    return out


def parse(argv: Sequence[str]) -> tuple[BenchConfig, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    defaults = BenchConfig(model_dir="")
    for name, value in asdict(defaults).items():
        if name != "model_dir":
            parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out = Path(args.pop("out"))
    return BenchConfig(**args), out


def main(argv: Sequence[str]) -> None:
    config, out = parse(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("note: fewer than 2 CPUs allowed: both workers share one core", file=sys.stderr)
    results = run_loads(config)
    report = {
        "command": "python -m bench.pd_bench " + " ".join(argv),
        "config": asdict(config),
        "host": {**host_info(), "cpus": sorted(os.sched_getaffinity(0))},
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
