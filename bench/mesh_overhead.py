"""Mesh overhead: the same engine in-process vs behind the full mesh, paired runs.

    python -m bench.mesh_overhead --model-dir DIR [--num-requests 128 --prompt-len 128
        --output-len 64 --concurrency 8,32 --repeats 3 --stream-intervals 1,8]
        --out bench/results/mesh_overhead.json

`engine_bench` runs every in-process row, then every mesh row, minutes apart; on a
shared machine the drift between the two halves can be larger than the overhead being
measured. Here both systems stay up for the whole run (the in-process
:class:`AsyncLLMEngine` in this process, the mesh as its own processes with a real
Redis) and the runs alternate — in-process, mesh, in-process, mesh, ... at each
concurrency — so each mesh run has an in-process run next to it. One mesh runs per
`--stream-intervals` value (the decoder worker's MESHSERVE_STREAM_INTERVAL: tokens per
stream message after the first), all alternating with the same in-process runs.
Reported per concurrency and mesh: the median tok/s of each system, every paired
overhead (1 - mesh/in-process of the same repeat) and their median, and TTFT / TPOT
medians.

With `--ttft-rounds R`, the TTFT the mesh adds at concurrency 1 is also measured in
short alternating blocks (`ttft_interleaved` in the report): R rounds, each running
`--ttft-block` sequential requests (8) through every system in a shuffled order, so
the two systems sample the host's speed within seconds of each other rather than a
minute apart (at c=1 a 128-request run lasts ~70 s, and the host's forward speed moves
by up to 20 % between adjacent runs: bench/README "Session 14"). Reported: the median
over rounds of the difference of block TTFT medians, and each system's median.
`--ttft-instances K` runs that measure over K in-process engines and K meshes of each
interval, all up at once (the throughput runs' mesh and K-1 more, started after those
runs so that idle meshes do not run beside them): a round runs a block on every
instance in a shuffled order, and a system's value for the round is the mean over its
instances. Two instances of the same system differ by up to ~1 ms
of c=1 TTFT for the whole of their life on this host (memory layout of the weights and
threads: bench/README "Session 15"), a bias as large as the effect measured that one
instance of each cannot average out. Each in-process instance of that measure runs in a
process of its own (`bench.engine_child`), as each mesh's worker does: engines sharing
one process slow each other's OpenMP barriers (bench/README "Session 17").

Both systems get the same engine settings (`max_num_seqs`, token budget, page size)
and the same torch thread count (the machine's default unless `--threads`, passed to
the worker as MESHSERVE_NUM_THREADS). Each run uses its own cache salt, so no run
reuses another's prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import torch

from bench.engine_bench import (
    DEFAULT_MODEL_DIR,
    GenerateFn,
    RunResult,
    Workload,
    engine_config,
    engine_generate_fn,
    make_workload,
    run_generate_workload,
)
from bench.engine_child import EngineChild
from bench.mesh_client import gateway_generate_fn, model_name, running_mesh
from bench.report import save
from services.launcher import Mesh
from worker_svc.engine import AsyncLLMEngine, EngineConfig
from worker_svc.engine.config import THREAD_PRIORITIES


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_service(mesh: Mesh) -> dict[str, float]:
    """CPU seconds so far of every mesh process and of this (client) process."""
    pids = {name: proc.pid for name, proc in mesh.procs.items()} | {"client": os.getpid()}
    return {name: _cpu_seconds(pid) for name, pid in pids.items()}


def engine_settings(args: argparse.Namespace, max_num_seqs: int) -> EngineConfig:
    """The in-process engine's configuration: the mesh's settings."""
    return engine_config(
        args, max_num_seqs, cpu_affinity=args.engine_cpus, thread_priority=args.engine_priority
    )


def _start_engine(args: argparse.Namespace, max_num_seqs: int) -> AsyncLLMEngine:
    """An in-process engine with the mesh's settings, started."""
    engine = AsyncLLMEngine(engine_settings(args, max_num_seqs))
    engine.start()
    return engine


async def _paired_runs(
    args: argparse.Namespace, workload: Workload, concurrencies: list[int], meshes: dict[str, Mesh]
) -> list[RunResult]:
    """Alternates the in-process run and each mesh's run; returns every row in run order.
    `meshes` maps a system name (mesh_si1, ...) to its running mesh. Mesh rows carry, in
    `notes`, the CPU milliseconds per output token each process spent during the run."""
    engine = _start_engine(args, max(concurrencies))
    connector = aiohttp.TCPConnector(limit=max(concurrencies) + 8)
    rows: list[RunResult] = []
    try:
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=600)
        ) as client:
            name = model_name(args.model_dir)
            await _warm_up(client, name, workload, [engine], list(meshes.values()))
            for repeat in range(args.repeats):
                for c in concurrencies:
                    salt = f"r{repeat}-c{c}"
                    local = engine_generate_fn(engine, "in-" + salt)
                    row, _ = await run_generate_workload(local, workload, c, "in_process")
                    rows.append(row)
                    line = f"repeat {repeat} c={c}: in_process {row.output_tok_per_s:.0f}"
                    for system, mesh in meshes.items():
                        remote = gateway_generate_fn(client, mesh.gateway_url, name, f"{system}-{salt}")
                        before = cpu_by_service(mesh)
                        row, _ = await run_generate_workload(remote, workload, c, system)
                        spent = {k: v - before.get(k, 0.0) for k, v in cpu_by_service(mesh).items()}
                        row.notes = "cpu ms/token: " + json.dumps(
                            {k: round(1000 * v / max(row.output_tokens, 1), 3) for k, v in spent.items()}
                        )
                        rows.append(row)
                        line += f" {system} {row.output_tok_per_s:.0f}"
                    print(line + " tok/s", flush=True)
    finally:
        await engine.shutdown()
    return rows


async def _warm_up(
    client: aiohttp.ClientSession,
    name: str,
    workload: Workload,
    engines: Sequence[AsyncLLMEngine],
    meshes: Sequence[Mesh],
    children: Sequence[EngineChild] = (),
) -> None:
    """A few short requests through every engine, engine child and mesh before anything
    is timed (a child runs them one at a time)."""
    warm = Workload(workload.prompts[:4], 4)
    for engine in engines:
        await run_generate_workload(engine_generate_fn(engine, "warm"), warm, 4, "warmup")
    for child in children:
        await child.run_block(warm, "warm", "warm")
    for mesh in meshes:
        fn = gateway_generate_fn(client, mesh.gateway_url, name, "warm")
        await run_generate_workload(fn, warm, 4, "warmup")


async def _interleaved_runs(
    args: argparse.Namespace, workload: Workload, max_num_seqs: int, meshes: dict[str, list[Mesh]]
) -> dict[str, Any]:
    """The interleaved c=1 TTFT measure over `--ttft-instances` in-process engines, each in
    a process of its own (`EngineChild`: several engines in one process slow each other
    down), and every mesh of `meshes` (system name -> its instances)."""
    count = len(next(iter(meshes.values())))
    children = [EngineChild(engine_settings(args, max_num_seqs), args.threads) for _ in range(count)]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
            name = model_name(args.model_dir)
            await _warm_up(client, name, workload, [], [m for ms in meshes.values() for m in ms], children)
            systems: dict[str, list[BlockRunner]] = {"in_process": [child.run_block for child in children]}
            for system, instances in meshes.items():
                systems[system] = [
                    generate_block(functools.partial(gateway_generate_fn, client, mesh.gateway_url, name))
                    for mesh in instances
                ]
            return await interleaved_ttft(systems, workload, args.ttft_rounds, args.ttft_block, args.seed)
    finally:
        for child in children:
            child.close()


# Runs a block of requests at concurrency 1 (its workload, cache salt and request id
# prefix) and returns the block's TTFT p50 in ms.
BlockRunner = Callable[[Workload, str, str], Awaitable[float]]


def generate_block(make_generate: Callable[[str], GenerateFn]) -> BlockRunner:
    """A BlockRunner over a GenerateFn factory (taking the cache salt), in this process."""

    async def run(workload: Workload, salt: str, id_prefix: str) -> float:
        row, _ = await run_generate_workload(make_generate(salt), workload, 1, "block", id_prefix)
        return row.ttft_ms["p50"]

    return run


async def interleaved_ttft(
    systems: Mapping[str, Sequence[BlockRunner]],
    workload: Workload,
    rounds: int,
    block: int,
    seed: int,
) -> dict[str, Any]:
    """TTFT at concurrency 1 in alternating blocks (see the module doc). `systems` maps a
    name to its instances, each a BlockRunner; "in_process" is the reference. A system's
    value for a round is the mean of its instances' block medians."""
    order = random.Random(seed)
    blocks: dict[tuple[str, int], list[float]] = {
        (name, i): [] for name, instances in systems.items() for i in range(len(instances))
    }
    for r in range(rounds):
        keys = list(blocks)
        order.shuffle(keys)
        prompts = [workload.prompts[(r * block + i) % len(workload.prompts)] for i in range(block)]
        for name, i in keys:
            ttft = await systems[name][i](
                Workload(prompts, workload.output_len), f"ttft-{name}-{i}-{r}", f"t{r}"
            )
            blocks[name, i].append(ttft)
    per_round = {  # a system's value in each round: the mean of its instances' block medians
        name: [statistics.fmean(v) for v in zip(*(blocks[name, i] for i in range(len(inst))), strict=True)]
        for name, inst in systems.items()
    }
    instance_medians = {
        name: [statistics.median(blocks[name, i]) for i in range(len(inst))] for name, inst in systems.items()
    }
    reference = per_round.pop("in_process")
    report: dict[str, Any] = {
        "rounds": rounds,
        "block": block,
        "instances": {name: len(inst) for name, inst in systems.items()},
        "in_process_ttft_block_p50_ms_median": statistics.median(reference),
        "in_process_instance_ttft_block_p50_ms_medians": instance_medians.pop("in_process"),
    }
    for name, values in per_round.items():
        added = [m - i for i, m in zip(reference, values, strict=True)]
        report[name] = {
            "ttft_block_p50_ms_median": statistics.median(values),
            "instance_ttft_block_p50_ms_medians": instance_medians[name],
            "ttft_added_ms_median": statistics.median(added),
            "ttft_added_ms_quartiles": statistics.quantiles(added, n=4) if len(added) > 1 else added,
            "rounds_at_or_under_3ms": sum(a <= 3.0 for a in added),
        }
        print(
            f"interleaved c=1 {name}: TTFT added median {report[name]['ttft_added_ms_median']:+.2f} ms "
            f"over {rounds} rounds of {block} (quartiles {', '.join(f'{q:+.2f}' for q in report[name]['ttft_added_ms_quartiles'])})",
            flush=True,
        )
    return report


# Processes of the mesh that relay rather than compute: everything but the workers,
# Redis and the benchmark client.
_NOT_RELAYS = ("decoder", "encoder", "embedding", "redis", "client")


def relay_cpu_ms(row: RunResult) -> float:
    """CPU ms per output token of the relays (gateway, scheduler replicas, tokenizer)
    during a mesh run, from the per-process figures in the row's notes."""
    spent: dict[str, float] = json.loads(row.notes.removeprefix("cpu ms/token: "))
    return sum(v for name, v in spent.items() if not name.startswith(_NOT_RELAYS))


def summarize_pairs(rows: list[RunResult], concurrencies: list[int]) -> list[dict[str, Any]]:
    """Per concurrency and mesh system: medians of each system and the paired overheads
    (the i-th run of a mesh is paired with the i-th in-process run at that concurrency)."""
    systems = sorted({r.system for r in rows} - {"in_process"})
    summary = []
    for c in concurrencies:
        local = [r for r in rows if r.concurrency == c and r.system == "in_process"]
        for system in systems:
            mesh = [r for r in rows if r.concurrency == c and r.system == system]
            overheads = [
                1 - m.output_tok_per_s / i.output_tok_per_s for i, m in zip(local, mesh, strict=True)
            ]
            summary.append(
                {
                    "concurrency": c,
                    "system": system,
                    "in_process_tok_per_s_median": statistics.median(r.output_tok_per_s for r in local),
                    "mesh_tok_per_s_median": statistics.median(r.output_tok_per_s for r in mesh),
                    "paired_overheads": [round(o, 4) for o in overheads],
                    "overhead_median": statistics.median(overheads),
                    "in_process_ttft_p50_ms_median": statistics.median(r.ttft_ms["p50"] for r in local),
                    "mesh_ttft_p50_ms_median": statistics.median(r.ttft_ms["p50"] for r in mesh),
                    "in_process_tpot_p50_ms_median": statistics.median(r.tpot_ms["p50"] for r in local),
                    "mesh_tpot_p50_ms_median": statistics.median(r.tpot_ms["p50"] for r in mesh),
                    "mesh_throughput_ratio_median": statistics.median(1 - o for o in overheads),
                    "ttft_p50_added_ms_median": statistics.median(
                        m.ttft_ms["p50"] - i.ttft_ms["p50"] for i, m in zip(local, mesh, strict=True)
                    ),
                    "relay_cpu_ms_per_token_median": statistics.median(relay_cpu_ms(m) for m in mesh),
                }
            )
    return summary


def parse_cpus(text: str) -> set[int]:
    """`"0"`, `"0-1,3"` → the CPU numbers (empty text: none)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pin_relays(pids: list[int], relay_cpus: set[int], engine_cpus: set[int]) -> int:
    """Pins every thread of `pids` to `relay_cpus`, except the engine step threads (those
    that pinned themselves to `engine_cpus`, the engine's `cpu_affinity`): the relays and
    the benchmark client then never take the engine's core, as with one pod per service
    and CPU requests. Threads started later inherit their creator's CPUs. Returns how many
    threads were pinned."""
    pinned = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            tid = int(task.name)
            with contextlib.suppress(ProcessLookupError):
                if os.sched_getaffinity(tid) != engine_cpus:
                    os.sched_setaffinity(tid, relay_cpus)
                    pinned += 1
    return pinned


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Starts the mesh, runs the paired repeats, returns the report."""
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workload = make_workload(args.model_dir, args.num_requests, args.prompt_len, args.output_len, args.seed)
    threads: tuple[tuple[str, str], ...] = (
        (("MESHSERVE_NUM_THREADS", str(args.threads)),) if args.threads else ()
    )
    threads += (("MESHSERVE_DTYPE", args.dtype),)  # the same dtype on both sides
    if args.engine_cpus:
        threads += (("MESHSERVE_CPU_AFFINITY", args.engine_cpus),)
    threads += (("MESHSERVE_ENGINE_PRIORITY", args.engine_priority),)  # the same on both sides
    intervals = [int(k) for k in args.stream_intervals.split(",")]
    with contextlib.ExitStack() as stack:
        meshes: dict[str, list[Mesh]] = {}

        def start_meshes(count: int) -> None:
            for k in intervals:
                for _ in range(count):
                    meshes.setdefault(f"mesh_si{k}", []).append(
                        stack.enter_context(
                            running_mesh(
                                args.model_dir,
                                max(concurrencies),
                                args.max_batch_tokens,
                                threads,
                                stream_interval=k,
                            )
                        )
                    )
            if args.relay_cpus:
                pids = [os.getpid(), *(p.pid for ms in meshes.values() for m in ms for p in m.procs.values())]
                pinned = pin_relays(pids, parse_cpus(args.relay_cpus), parse_cpus(args.engine_cpus))
                print(f"pinned {pinned} relay/client threads to CPUs {args.relay_cpus}", flush=True)

        start_meshes(1)
        first = {system: instances[0] for system, instances in meshes.items()}
        rows = asyncio.run(_paired_runs(args, workload, concurrencies, first))
        interleaved: dict[str, Any] = {}
        if args.ttft_rounds:
            # The other instances only now: idle meshes beside the throughput runs would
            # take CPU from them (heartbeats, load reports, model-list refreshes).
            start_meshes(max(1, args.ttft_instances) - 1)
            interleaved = asyncio.run(_interleaved_runs(args, workload, max(concurrencies), meshes))
    return {
        "model_dir": args.model_dir,
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "concurrency": concurrencies,
            "max_batch_tokens": args.max_batch_tokens,
            "repeats": args.repeats,
            "stream_intervals": intervals,
            "ttft_instances": max(1, args.ttft_instances),
            "dtype": args.dtype,
            "engine_cpus": args.engine_cpus,
            "relay_cpus": args.relay_cpus,
            "engine_priority": args.engine_priority,
        },
        "env": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()},
        "summary": summarize_pairs(rows, concurrencies),
        "ttft_interleaved": interleaved,
        "runs": [asdict(r) for r in rows],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream-intervals", default="1,8", help="one mesh per decoder stream interval")
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=0, help="torch threads of both systems (0: default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--engine-cpus",
        default="",
        help="CPUs of the engine step thread, both systems (e.g. 1; empty: no pinning)",
    )
    p.add_argument(
        "--engine-priority",
        default="auto",
        choices=THREAD_PRIORITIES,
        help="scheduling class of the engine's threads, both systems (EngineConfig.thread_priority)",
    )
    p.add_argument(
        "--relay-cpus",
        default="",
        help="CPUs of every other thread: the mesh's relays, the worker's event loop and this client (e.g. 0)",
    )
    p.add_argument("--dtype", default="float32", help="model dtype of both systems")
    p.add_argument(
        "--ttft-rounds", type=int, default=0, help="rounds of the interleaved c=1 TTFT measure (0: off)"
    )
    p.add_argument("--ttft-block", type=int, default=8, help="sequential requests per system and round")
    p.add_argument(
        "--ttft-instances",
        type=int,
        default=1,
        help="in-process engines and meshes per interval in the interleaved TTFT measure",
    )
    p.add_argument("--out", default="bench/results/mesh_overhead.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    report = save("bench.mesh_overhead", argv, run(args), args.out)
    for s in report["summary"]:
        print(
            f"c={s['concurrency']} {s['system']}: in-process {s['in_process_tok_per_s_median']:.0f} tok/s, "
            f"mesh {s['mesh_tok_per_s_median']:.0f} tok/s, overhead median {s['overhead_median']:+.1%} "
            f"(pairs {', '.join(f'{o:+.1%}' for o in s['paired_overheads'])}); relay CPU "
            f"{s['relay_cpu_ms_per_token_median']:.3f} ms/token; TTFT p50 +{s['ttft_p50_added_ms_median']:.1f} ms"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
