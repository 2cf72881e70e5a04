"""Routing benchmark: prefix-aware vs round-robin vs least-load scheduling, side by side.

    python -m bench.routing_bench [--model-dir DIR] [--workers 2]
        [--policies prefix,round_robin,least_load]
        [--loads 8,16,32 | --concurrency 8 |
         --session-rates 2,3,4,5 (--sessions 40 | --duration 30) --think-time 1]
        [--conversations 32 --turns 5 --system-prompts 4 --system-len 256 --user-len 128]
        [--cache-fraction 1.1 | --num-kv-blocks N] [--max-inflight-per-worker 32]
        [--hot-prefix-share 0.8] [--repeats 3] [--out bench/results/routing_open.json] [--plot OUT.png]

For every (load, policy) a fresh mesh is started by `launcher.mesh.Mesh` -- a
redis-server, the scheduler with routing policy P and `--workers` decoder processes, no
gateway or tokenizer -- and the same seeded workload is sent as token ids the way the gateway
sends it: a route on `Scheduler.RouteStream` (admission + routing, a lease on one
worker), then the request on that worker (`Worker.GenerateStream`), then the lease's
release on the stream carrying the actual cached tokens (`LeaseOutcome`). The workload:
multi-turn conversations, each opening with one of a few shared system prompts (with
`--hot-prefix-share`, that share of them opens with prompt 0), every turn appending a
user message and the model's answer to the history.

Two load modes:
- closed loop (`--loads` / `--concurrency`): that many conversations in flight, a new turn
  the moment a slot frees; the load adapts to the policy's speed.
- open loop (`--session-rates R1,R2,..`, sessions per second): `--sessions` sessions, or
  with `--duration D` round(R x D) of them (distinct conversations; 0 = `--conversations`)
  start as a seeded Poisson process at rate R, each sending its turns one after another
  (the next turn when the previous answer arrived, after an optional exponential think
  time of mean `--think-time` s).
  The offered load, R x turns requests/s, is the same for every policy (same arrival
  times, same conversations): a policy that cannot serve it builds queues, one that can
  does not. Results are keyed "rate=R"; each run adds the achieved request rate, the
  requests the client has in flight (queued anywhere in the mesh) and live sessions,
  and a timeline of those and of each worker's queue every 0.5 s.

Sizing: the working set (distinct full KV blocks of every conversation's final history)
is printed with the cache sizes; `--cache-fraction F` sets num_kv_blocks so that all
workers' caches together hold F x the working set (F slightly above 1: larger than ONE
worker's cache, smaller than all of them).

Reported per policy (medians over `--repeats`, the policy order alternating): prefix-cache
hit rate (sum of `usage.cached_tokens` / prompt tokens) next to the ideal hit rate (an
LRU of all workers' memory on the same request sequence: one worker with all the
memory), TTFT p50/p99, latency, request and output-token throughput, the busiest
worker's time-averaged queue (running + waiting, from ListWorkers) over the mean, the
routing policy's own time (`meshserve_scheduler_policy_seconds`), the scheduler's route
time (`meshserve_scheduler_overhead_seconds`, admission queueing included), a probe of
`--route-probes` sequential routes + releases after the run (a route end to end
without queueing), predicted vs actual cached tokens, and the routing reasons; then the
prefix policy's ratios against the others and the issue's targets.
Without `--model-dir` the `make model` model is used, else a tiny untrained one is built
once (devtools.build_model --tiny).
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
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import grpc

from bench.host import host_info
from bench.mesh_client import cpu_seconds
from bench.routing_client import (
    MODEL_NAME,
    Mesh,
    probe_route,
    run_conversation,
    run_session,
    sample_queues,
    wait_ready,
    warm_up,
)
from bench.routing_metrics import (
    HistogramSnapshot,
    Record,
    comparison,
    ideal_hit_rate,
    medians,
    open_loop_summary,
    percentile,
    prediction_error,
    queue_balance,
    routing_reasons,
    scrape,
    summarize,
)
from bench.routing_plot import plot_routing
from bench.routing_workload import (
    BenchConfig,
    Conversation,
    build_workload,
    open_loop_schedule,
    session_count,
    sized,
    working_set_blocks,
)
from launcher import mesh as launcher
from launcher.mesh import free_ports_config
from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "routing_open.json"
DEFAULT_MODEL_DIR = ROOT / ".cache" / "models" / "smollm2-135m-instruct"  # `make model`
TINY_MODEL_DIR = ROOT / ".cache" / "models" / "meshserve-routing-bench-tiny"
OVERHEAD_METRIC = "meshserve_scheduler_overhead_seconds"
POLICY_METRIC = "meshserve_scheduler_policy_seconds"


def start_mesh(config: BenchConfig, policy: str, log_dir: Path) -> launcher.Mesh:
    """redis-server, the scheduler with `policy` and `config.workers` decoders on free
    ports (launcher.mesh, as `make serve` starts them), once all are healthy."""
    settings = {
        "block_size": config.block_size,
        "num_kv_blocks": config.num_kv_blocks,
        "num_threads": config.num_threads,
        "device": config.device,
        "max_inflight_per_worker": config.max_inflight_per_worker,
        "log_level": "WARNING",
    }
    mesh_config = free_ports_config(
        model_dir=config.model_dir,
        served_model_name=MODEL_NAME,
        embedding_model_dir="",
        num_decoders=config.workers,
        only="scheduler,decoder",
        routing_policy=policy,
        max_num_seqs=config.max_num_seqs,
        log_dir=str(log_dir / policy),
        metrics_ports=(("scheduler", free_port()),),
        # Each service takes the settings it has (block_size: scheduler and decoders alike).
        extra_env=tuple((f"MESHSERVE_{name.upper()}", str(value)) for name, value in settings.items()),
    )
    return launcher.Mesh(mesh_config).start(timeout=300)


def metrics_port(mesh: launcher.Mesh) -> int:
    """The scheduler's Prometheus port."""
    return dict(mesh.config.metrics_ports)["scheduler"]


def policy_cost(config: BenchConfig, workload: list[Conversation], rounds: int = 3) -> dict[str, float]:
    """The prefix policy alone, in this process (no RPC, no other process's CPU): `choose`
    (prompt hashing, index match, scoring, speculative insert) for every turn of the
    workload, conversations interleaved as in the run, workers with random loads."""
    from scheduler_svc.policies import PrefixAwarePolicy, RoutingRequest
    from scheduler_svc.prefix_index import PrefixIndex
    from scheduler_svc.registry import LoadSnapshot, WorkerSpec, WorkerState

    rng = random.Random(config.seed)
    workers = []
    for i in range(config.workers):
        spec = WorkerSpec(
            f"w{i}", "addr", "decoder", MODEL_NAME, 4096, config.block_size, config.num_kv_blocks, 8
        )
        workers.append(WorkerState(spec, capacity=32, load=LoadSnapshot()))
    timings: list[float] = []
    for _ in range(rounds):
        policy = PrefixAwarePolicy(PrefixIndex(speculative_ttl_s=3600.0))
        histories = [list(conv.system) for conv in workload]
        for turn in range(config.turns):
            for index, conv in enumerate(workload):
                histories[index].extend(conv.turns[turn])
                for worker in workers:
                    worker.external_load = rng.randrange(0, 12)
                request = RoutingRequest(f"r{index}-{turn}", MODEL_NAME, list(histories[index]))
                start = time.perf_counter()
                policy.choose(request, workers)
                timings.append((time.perf_counter() - start) * 1000)
                histories[index].extend(rng.randrange(3, config.vocab) for _ in range(config.max_tokens))
    return {"p50": percentile(timings, 50), "p99": percentile(timings, 99), "max": max(timings),
            "count": len(timings)}  # fmt: skip


async def run_policy(
    config: BenchConfig, policy: str, workload: list[Conversation], log_dir: Path
) -> dict[str, Any]:
    cluster = await asyncio.to_thread(start_mesh, config, policy, log_dir)
    try:
        async with grpc.aio.insecure_channel(cluster.specs["scheduler"].address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            mesh = Mesh(stub)
            try:
                await wait_ready(stub, config.workers)
                await warm_up(mesh, config)
                summary = await measure(config, cluster, stub, mesh, workload)
            finally:
                await mesh.close()
        return summary
    finally:
        await asyncio.to_thread(cluster.stop, 30)


async def measure(
    config: BenchConfig, cluster: launcher.Mesh, stub: scheduler_pb2_grpc.SchedulerStub, mesh: Mesh,
    workload: list[Conversation],
) -> dict[str, Any]:  # fmt: skip
    """One run of the workload on a ready cluster, then the route probe."""
    before = await asyncio.to_thread(scrape, metrics_port(cluster))
    records: list[Record] = []
    samples: dict[str, list[int]] = {}
    timeline: list[dict[str, Any]] = []
    loop = open_loop_schedule(config, len(workload)) if config.session_rate > 0 else None
    sampler = asyncio.create_task(sample_queues(stub, samples, loop=loop, timeline=timeline))
    cpu_before = cpu_seconds(cluster)
    start = time.perf_counter()
    if loop is not None:
        loop.start = start
        await asyncio.gather(
            *(run_session(mesh, conv, i, config, loop, records) for i, conv in enumerate(workload))
        )
    else:
        gate = asyncio.Semaphore(config.concurrency)
        await asyncio.gather(
            *(run_conversation(mesh, conv, i, config, gate, records) for i, conv in enumerate(workload))
        )
    wall = time.perf_counter() - start
    sampler.cancel()
    cpu = {k: round(v - cpu_before.get(k, 0.0), 3) for k, v in cpu_seconds(cluster).items()}
    after = await asyncio.to_thread(scrape, metrics_port(cluster))
    await asyncio.sleep(1.0)  # one more heartbeat with the final LoadStats
    listing = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
    probe_before = await asyncio.to_thread(scrape, metrics_port(cluster))
    probe = await probe_route(mesh, records, config.route_probes)
    probe_after = await asyncio.to_thread(scrape, metrics_port(cluster))

    def delta(name: str, first: str, last: str) -> HistogramSnapshot:
        return HistogramSnapshot.parse(last, name).minus(HistogramSnapshot.parse(first, name))

    summary = summarize(records, wall, list(listing.workers), delta(OVERHEAD_METRIC, before, after))
    summary["ideal_hit_rate"] = ideal_hit_rate(
        records, config.num_kv_blocks * config.workers, config.block_size
    )
    summary["policy_ms"] = delta(POLICY_METRIC, before, after).summary_ms()
    summary["route_probe_ms"] = probe
    summary["route_probe_overhead_ms"] = delta(OVERHEAD_METRIC, probe_before, probe_after).summary_ms()
    summary["queues"] = queue_balance(samples)
    summary["cached_tokens_prediction"] = prediction_error(records)
    reasons_before = routing_reasons(before)
    summary["routing_reasons"] = {
        reason: count - reasons_before.get(reason, 0.0) for reason, count in routing_reasons(after).items()
    }
    summary["cpu_seconds"] = cpu
    summary["loadavg"] = os.getloadavg()
    if loop is not None:
        summary["open_loop"] = open_loop_summary(config, loop, records, wall, timeline)
        summary["timeline"] = timeline
    return summary


def ensure_model(model_dir: str | None) -> str:
    if model_dir:
        return model_dir
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return str(DEFAULT_MODEL_DIR)
    if not (TINY_MODEL_DIR / "config.json").is_file():
        print(f"building a tiny model in {TINY_MODEL_DIR}", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "devtools.build_model", "--tiny", "--out", str(TINY_MODEL_DIR)],
            check=True,
            cwd=ROOT,
        )
    return str(TINY_MODEL_DIR)


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, Path, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m bench.routing_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, default=None, help="also draw the report into this PNG")
    defaults = BenchConfig(model_dir="")
    for name, value in asdict(defaults).items():
        if name == "model_dir":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, tuple):
            parser.add_argument(flag, default=",".join(value))
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out, plot = args.pop("out"), args.pop("plot")
    for name, value in asdict(defaults).items():
        if isinstance(value, tuple):  # comma-separated lists: policies, loads
            args[name] = tuple(p.strip() for p in args[name].split(",") if p.strip())
    args["model_dir"] = ensure_model(args["model_dir"])
    return BenchConfig(**args), out, plot


async def run_all(
    config: BenchConfig, workload: list[Conversation], log_dir: Path
) -> dict[str, dict[str, Any]]:
    """Every (load, policy) `repeats` times; per repeat the policy order alternates. A load
    is a concurrency ("c=N", closed loop) or a session rate ("rate=R", open loop)."""
    loads: dict[str, BenchConfig] = (
        {f"rate={r}": replace(config, session_rate=float(r)) for r in config.session_rates}
        if config.session_rates
        else {f"c={c}": replace(config, concurrency=int(c)) for c in config.loads or [config.concurrency]}
    )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        load: {policy: [] for policy in config.policies} for load in loads
    }
    for repeat in range(config.repeats):
        order = config.policies if repeat % 2 == 0 else tuple(reversed(config.policies))
        for load, load_config in loads.items():
            for policy in order:
                tag = f"[{load} {policy} #{repeat + 1}]"
                print(f"{tag} starting {config.workers} workers ...", file=sys.stderr)
                sessions = workload[: session_count(config, load_config.session_rate)]
                run = await run_policy(
                    load_config, policy, sessions if config.session_rates else workload, log_dir
                )
                runs[load][policy].append(run)
                brief = {k: v for k, v in run.items() if k != "timeline"}
                print(f"{tag} {json.dumps(brief)}", file=sys.stderr)
    return {
        load: {policy: {"median": medians(r), "runs": r} for policy, r in by_policy.items()}
        for load, by_policy in runs.items()
    }


async def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    config, out, plot = parse_args(argv)
    workload = build_workload(config)
    # The caches are sized on `conversations` in both modes; an open loop sends `sessions`
    # distinct conversations (the first `conversations` of them are the closed loop's).
    config, sizes = sized(config, workload)
    if config.session_rates:
        most = max(session_count(config, float(rate)) for rate in config.session_rates)
        workload = build_workload(replace(config, conversations=most))
        sizes["sessions"] = len(workload)  # the largest run's
        sizes["sessions_per_rate"] = {r: session_count(config, float(r)) for r in config.session_rates}
        sizes["sessions_total_blocks"] = working_set_blocks(workload, config)
        shared = config.system_prompts * (config.system_len // config.block_size)
        # A session's own blocks (its history without the shared system prompt): the live
        # working set is about live sessions x this + the system prompts.
        sizes["own_blocks_per_session"] = (sizes["sessions_total_blocks"] - shared) / len(workload)
    print(f"sizes: {json.dumps(sizes)}", file=sys.stderr)
    log_dir = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    runs = [policy_cost(config, workload) for _ in range(3)]  # spikes of a shared host: median of 3
    cost: dict[str, Any] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    cost["runs"] = runs
    print(f"prefix policy in-process, ms per decision: {json.dumps(cost)}", file=sys.stderr)
    # --repeats 0: only the sizes and the in-process policy cost.
    results = await run_all(config, workload, log_dir) if config.repeats > 0 else {}
    report = {
        "command": "python -m bench.routing_bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "note": "policies run side by side in one invocation, alternating order per repeat; "
        "figures under 'median' are medians over the repeats (shared, noisy 2-core host)",
        "config": asdict(config),
        "sizes": sizes,
        "policy_in_process_ms": cost,
        "host": host_info(),
        "results": results,
        "comparison": {load: comparison(by_policy) for load, by_policy in results.items()},
        "logs": str(log_dir),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    if plot is not None:
        print(f"wrote {plot_routing(report, plot)}", file=sys.stderr)
    return report


if __name__ == "__main__":
    asyncio.run(main())
