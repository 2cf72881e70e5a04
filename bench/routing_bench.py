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
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.host import host_info
from gateway.route_stream import RouteStream
from launcher import mesh as launcher
from launcher.mesh import free_ports_config
from meshserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.kv_hash import block_hashes
from services.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "routing_open.json"
DEFAULT_MODEL_DIR = ROOT / ".cache" / "models" / "smollm2-135m-instruct"  # `make model`
TINY_MODEL_DIR = ROOT / ".cache" / "models" / "meshserve-routing-bench-tiny"
OVERHEAD_METRIC = "meshserve_scheduler_overhead_seconds"
POLICY_METRIC = "meshserve_scheduler_policy_seconds"
MODEL_NAME = "bench-model"


@dataclass(frozen=True)
class BenchConfig:
    model_dir: str
    workers: int = 2
    policies: tuple[str, ...] = ("prefix", "round_robin")
    conversations: int = 32
    turns: int = 5
    system_prompts: int = 4
    system_len: int = 256
    user_len: int = 128
    max_tokens: int = 16
    concurrency: int = 8
    num_kv_blocks: int = 1024
    max_num_seqs: int = 16
    block_size: int = 16
    num_threads: int = 1
    device: str = "cpu"
    vocab: int = 900
    seed: int = 0
    # Runs per policy, alternating the policy order (the host may be noisy).
    repeats: int = 1
    # > 0: size num_kv_blocks so that all workers' caches together hold this multiple of
    # the working set (e.g. 1.3 with 2 workers: one cache holds 0.65 of it).
    cache_fraction: float = 0.0
    # > 0: this share of conversations opens with system prompt 0 (hot-prefix skew test).
    hot_prefix_share: float = 0.0
    # Scheduler's max_inflight_per_worker (0 = the worker's max_num_seqs); above
    # max_num_seqs requests queue at the worker the policy chose, not in the scheduler.
    max_inflight_per_worker: int = 0
    # Concurrency sweep (TTFT vs load); empty = just `concurrency`.
    loads: tuple[str, ...] = ()
    # Sequential routes + releases after each run (a route's cost without queueing).
    route_probes: int = 200
    # Open loop: session arrival rates (sessions/s) to sweep; empty = closed loop.
    session_rates: tuple[str, ...] = ()
    # Open loop: sessions per run, each a distinct conversation (0 = `conversations`).
    sessions: int = 0
    # Open loop: > 0 sends round(rate x duration) sessions instead (arrivals over ~duration s,
    # so every rate runs about as long and reaches its steady state).
    duration: float = 0.0
    # Open loop: mean think time (s, exponential) between an answer and the next turn.
    think_time: float = 0.0
    # Open loop: the rate of the current run (set per run from `session_rates`).
    session_rate: float = 0.0


@dataclass(frozen=True)
class Conversation:
    system: tuple[int, ...]
    turns: tuple[tuple[int, ...], ...]


@dataclass
class Record:
    """One request's measurements."""

    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    # Client-side latency of a route on the RouteStream.
    route_s: float
    worker_id: str
    started: float = 0.0
    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()
    predicted_cached_tokens: int = 0


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


def cpu_seconds(mesh: launcher.Mesh) -> dict[str, float]:
    """CPU time (user + system) used so far by each process (Linux /proc; {} elsewhere)."""
    result: dict[str, float] = {}
    for name, proc in mesh.procs.items():
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        result[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return result


def build_workload(config: BenchConfig) -> list[Conversation]:
    """Seeded conversations: shared system prompts, random user turns (token ids)."""
    rng = random.Random(config.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, config.vocab) for _ in range(n))

    systems = [tokens(config.system_len) for _ in range(config.system_prompts)]

    def system() -> tuple[int, ...]:
        if config.hot_prefix_share > 0 and rng.random() < config.hot_prefix_share:
            return systems[0]
        return rng.choice(systems)

    return [
        Conversation(system(), tuple(tokens(config.user_len) for _ in range(config.turns)))
        for _ in range(config.conversations)
    ]


def working_set_blocks(workload: list[Conversation], config: BenchConfig) -> int:
    """Distinct full KV blocks of every conversation's final history (system prompt, user
    turns, `max_tokens` answers; answers stand in as distinct tokens, only counts matter)."""
    blocks: set[int] = set()
    for index, conv in enumerate(workload):
        history = list(conv.system)
        for turn, user in enumerate(conv.turns):
            history.extend(user)
            history.extend(10**9 + index * 1000 + turn * 50 + k for k in range(config.max_tokens))
        blocks.update(block_hashes(history, config.block_size))
    return len(blocks)


def sized(config: BenchConfig, workload: list[Conversation]) -> tuple[BenchConfig, dict[str, Any]]:
    """The config with num_kv_blocks from cache_fraction, and the sizes to print/report."""
    ws = working_set_blocks(workload, config)
    if config.cache_fraction > 0:
        config = replace(config, num_kv_blocks=math.ceil(ws * config.cache_fraction / config.workers))
    sizes = {
        "working_set_blocks": ws,
        "kv_blocks_per_worker": config.num_kv_blocks,
        "kv_blocks_all_workers": config.num_kv_blocks * config.workers,
        "working_set_over_one_worker": ws / config.num_kv_blocks,
        "working_set_over_all_workers": ws / (config.num_kv_blocks * config.workers),
    }
    return config, sizes


def ideal_hit_rate(records: list[Record], capacity_blocks: int, block_size: int) -> float:
    """The hit rate of ONE worker holding `capacity_blocks` (all workers' memory) on the
    same request sequence: an LRU of block hashes, hits capped like the block manager
    ((prompt - 1) // block_size full blocks), prompt + output blocks stored after each."""
    lru: OrderedDict[int, None] = OrderedDict()
    cached = prompt = 0
    for record in sorted(records, key=lambda r: r.started):
        hashes = block_hashes(record.prompt, block_size)
        limit = (len(record.prompt) - 1) // block_size
        hit = 0
        while hit < min(limit, len(hashes)) and hashes[hit] in lru:
            hit += 1
        cached += hit * block_size
        prompt += len(record.prompt)
        for block in block_hashes(record.prompt + record.output, block_size):
            lru[block] = None
            lru.move_to_end(block)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return cached / prompt if prompt else 0.0


async def wait_ready(stub: scheduler_pb2_grpc.SchedulerStub, workers: int, timeout: float = 300) -> list[str]:
    """Addresses of the workers once all of them are registered and healthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.aio.AioRpcError):
            reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
            healthy = [
                s.worker.address
                for s in reply.workers
                if s.healthy and s.worker.role == worker_pb2.WORKER_ROLE_DECODER
            ]
            if len(healthy) >= workers:
                return healthy
        await asyncio.sleep(0.5)
    raise TimeoutError("workers did not register in time")


def _request(prompt: Sequence[int], max_tokens: int, request_id: str) -> common_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return common_pb2.GenerateRequest(
        request_id=request_id, model=MODEL_NAME, prompt_token_ids=list(prompt), sampling=sampling
    )


class Mesh:
    """The client side: a route stream to the scheduler and one channel per worker (as a
    gateway keeps)."""

    def __init__(self, scheduler: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.routes = RouteStream(scheduler, "scheduler")
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def route(self, request: common_pb2.GenerateRequest, timeout: float) -> scheduler_pb2.RouteResponse:
        """A lease for `request` (a refused route raises its grpc.aio.AioRpcError)."""
        message = scheduler_pb2.RouteStreamRequest(route=scheduler_pb2.RouteRequest(request=request))
        return await self.routes.route(message, timeout)

    def release(self, release: scheduler_pb2.ReleaseRequest) -> None:
        """Releases on the route stream (in the background, as the gateway does)."""
        self.routes.release(release)

    def worker(self, address: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return worker_pb2_grpc.WorkerStub(channel)

    async def close(self) -> None:
        await self.routes.close()
        for channel in self._channels.values():
            await channel.close()


async def _generate_one(
    stub: worker_pb2_grpc.WorkerStub, request: common_pb2.GenerateRequest
) -> AsyncIterator[common_pb2.GenerateResponse]:
    """The request alone on a Worker.GenerateStream (half-closed after the add): its
    responses up to the finished one; a RequestError raises."""
    call = stub.GenerateStream(timeout=600)
    try:
        await call.write(worker_pb2.GenerateStreamRequest(add=request))
        await call.done_writing()
        async for message in call:
            for error in message.errors:
                raise RuntimeError(f"request {error.request_id} failed ({error.code}): {error.message}")
            for output in message.outputs:
                yield output
    finally:
        call.cancel()


async def send(
    mesh: Mesh, prompt: Sequence[int], max_tokens: int, request_id: str
) -> tuple[Record, list[int]]:
    """Route, the request on the routed worker's GenerateStream, release; the record and
    the tokens."""
    request = _request(prompt, max_tokens, request_id)
    start = time.perf_counter()
    route = await mesh.route(request, timeout=600)
    routed = time.perf_counter()
    request.lease_id = route.lease_id
    ttft = 0.0
    output: list[int] = []
    last: Any = None
    try:
        async for response in _generate_one(mesh.worker(route.worker_address), request):
            new = [t for delta in response.deltas if delta.index == 0 for t in delta.token_ids]
            if new and not output:
                ttft = time.perf_counter() - start
            output.extend(new)
            last = response
    finally:
        usage = last.usage if last is not None else common_pb2.Usage()
        # The actual cached tokens go back with the lease, as the gateway sends them.
        outcome = scheduler_pb2.LeaseOutcome(
            lease_id=route.lease_id, cached_tokens=usage.cached_tokens, prompt_tokens=usage.prompt_tokens
        )
        mesh.release(scheduler_pb2.ReleaseRequest(outcomes=[outcome]))
    latency = time.perf_counter() - start
    record = Record(ttft, latency, usage.prompt_tokens, usage.cached_tokens, len(output),
                    routed - start, route.worker_id, start, tuple(prompt), tuple(output),
                    route.predicted_cached_tokens)  # fmt: skip
    return record, output


async def run_conversation(
    mesh: Mesh, conv: Conversation, index: int, config: BenchConfig,
    gate: asyncio.Semaphore, records: list[Record],
) -> None:  # fmt: skip
    history = list(conv.system)
    for turn, user in enumerate(conv.turns):
        history.extend(user)
        async with gate:
            record, output = await send(mesh, history, config.max_tokens, f"c{index}-t{turn}")
        records.append(record)
        history.extend(output)


@dataclass
class OpenLoop:
    """An open-loop run's schedule and client-side gauges (sampled with the workers' queues)."""

    # Start times of the sessions (s after `start`) and per-session think times before each turn.
    arrivals: list[float]
    think: list[list[float]]
    start: float = 0.0
    live_sessions: int = 0
    in_flight: int = 0
    failed: int = 0


def open_loop_schedule(config: BenchConfig, sessions: int) -> OpenLoop:
    """Seeded Poisson arrivals at `config.session_rate` and exponential think times: the
    same for every policy and repeat, so the offered load does not depend on the policy."""
    rng = random.Random(config.seed + 7919)
    arrivals, at = [], 0.0
    for _ in range(sessions):
        arrivals.append(at)
        at += rng.expovariate(config.session_rate)
    think = [
        [rng.expovariate(1 / config.think_time) if config.think_time > 0 and turn else 0.0
         for turn in range(config.turns)]
        for _ in range(sessions)
    ]  # fmt: skip
    return OpenLoop(arrivals, think)


async def run_session(
    mesh: Mesh, conv: Conversation, index: int, config: BenchConfig, loop: OpenLoop,
    records: list[Record],
) -> None:  # fmt: skip
    """One open-loop session: starts at its arrival time, then turn after turn."""
    await asyncio.sleep(max(0.0, loop.start + loop.arrivals[index] - time.perf_counter()))
    loop.live_sessions += 1
    history = list(conv.system)
    try:
        for turn, user in enumerate(conv.turns):
            if loop.think[index][turn] > 0:
                await asyncio.sleep(loop.think[index][turn])
            history.extend(user)
            loop.in_flight += 1
            try:
                record, output = await send(mesh, history, config.max_tokens, f"s{index}-t{turn}")
            except grpc.aio.AioRpcError:
                # Rejected or timed out (overload): the user gives up, the session ends.
                loop.failed += 1
                return
            finally:
                loop.in_flight -= 1
            records.append(record)
            history.extend(output)
    finally:
        loop.live_sessions -= 1


def session_count(config: BenchConfig, rate: float) -> int:
    """How many sessions an open-loop run at `rate` starts: rate x duration, else `sessions`/`conversations`."""
    if config.duration > 0:
        return max(1, round(rate * config.duration))
    return config.sessions or config.conversations


def zero_latency_request_rate(config: BenchConfig, sessions: int) -> float:
    """The request rate a mesh answering instantly would achieve on this schedule (all
    requests over the last session's arrival + think times): the "keeps up" line for the
    achieved rate, which the ramp-up and the last sessions' think times keep below
    `session_rate x turns` even without any queue."""
    loop = open_loop_schedule(config, sessions)
    end = max((at + sum(think) for at, think in zip(loop.arrivals, loop.think, strict=True)), default=0.0)
    return sessions * config.turns / end if end else float("nan")


def open_loop_summary(
    config: BenchConfig, loop: OpenLoop, records: list[Record], wall_s: float,
    timeline: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """Offered vs achieved load and the client-side queue of an open-loop run."""
    span = loop.arrivals[-1] if loop.arrivals else 0.0
    done_in_span = sum(r.started + r.latency_s - loop.start <= span for r in records)
    in_flight = [row["client_in_flight"] for row in timeline] or [0]
    live = [row["live_sessions"] for row in timeline] or [0]
    return {
        "offered_session_rate": config.session_rate,
        "offered_request_rate": config.session_rate * config.turns,
        "sessions": len(loop.arrivals),
        "arrival_span_s": span,
        "achieved_request_rate": len(records) / wall_s if wall_s else float("nan"),
        "zero_latency_request_rate": zero_latency_request_rate(config, len(loop.arrivals)),
        "request_rate_during_arrivals": done_in_span / span if span else float("nan"),
        "drain_s": wall_s - span,
        "failed_requests": loop.failed,
        "client_in_flight": {"mean": statistics.fmean(in_flight), "max": max(in_flight)},
        "live_sessions": {"mean": statistics.fmean(live), "max": max(live)},
    }


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def scrape(metrics_port: int) -> str:
    """The scheduler's /metrics text ("" when unreachable)."""
    try:
        return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""


def routing_reasons(text: str) -> dict[str, float]:
    """meshserve_scheduler_routed_total by reason."""
    reasons: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshserve_scheduler_routed_total":
                reason = sample.labels["reason"]
                reasons[reason] = reasons.get(reason, 0.0) + sample.value
    return reasons


@dataclass
class HistogramSnapshot:
    """Cumulative bucket counts (by upper bound), sum and count of one histogram."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0

    @classmethod
    def parse(cls, text: str, name: str) -> HistogramSnapshot:
        snapshot = cls()
        for family in text_string_to_metric_families(text):
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name == name + "_bucket":
                    snapshot.buckets[float(sample.labels["le"])] = sample.value
                elif sample.name == name + "_sum":
                    snapshot.sum = sample.value
                elif sample.name == name + "_count":
                    snapshot.count = sample.value
        return snapshot

    def minus(self, before: HistogramSnapshot) -> HistogramSnapshot:
        """The observations made between `before` and this snapshot."""
        return HistogramSnapshot(
            {le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.sum - before.sum,
            self.count - before.count,
        )

    def quantile(self, q: float) -> float:
        """Prometheus' histogram_quantile: linear interpolation inside the bucket."""
        if self.count <= 0 or not self.buckets:
            return float("nan")
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le, cumulative in sorted(self.buckets.items()):
            if cumulative >= rank:
                if le == float("inf"):
                    return lower_bound  # above the highest finite bucket
                inside = cumulative - lower_count
                fraction = (rank - lower_count) / inside if inside > 0 else 1.0
                return lower_bound + (le - lower_bound) * fraction
            lower_bound, lower_count = le, cumulative
        return lower_bound

    def summary_ms(self) -> dict[str, float]:
        mean = self.sum / self.count if self.count > 0 else float("nan")
        return {
            "p50": self.quantile(0.5) * 1000,
            "p99": self.quantile(0.99) * 1000,
            "mean": mean * 1000,
            "count": self.count,
        }


def ttft_by_hit(records: list[Record]) -> dict[str, float]:
    """TTFT p50 (ms) of requests mostly served from the prefix cache vs mostly not."""
    hit = [r.ttft_s * 1000 for r in records if r.prompt_tokens and r.cached_tokens / r.prompt_tokens >= 0.5]
    miss = [r.ttft_s * 1000 for r in records if r.prompt_tokens and r.cached_tokens / r.prompt_tokens < 0.5]
    return {"hit_ge_50pct_p50": percentile(hit, 50), "hit_lt_50pct_p50": percentile(miss, 50),
            "hit_ge_50pct_requests": len(hit), "hit_lt_50pct_requests": len(miss)}  # fmt: skip


def summarize(
    records: list[Record], wall_s: float, workers: list[Any], overhead: HistogramSnapshot
) -> dict[str, Any]:
    ttft = [r.ttft_s * 1000 for r in records]
    latency = [r.latency_s * 1000 for r in records]
    route = [r.route_s * 1000 for r in records]
    prompt = sum(r.prompt_tokens for r in records)
    per_worker: dict[str, int] = {}
    for r in records:
        per_worker[r.worker_id] = per_worker.get(r.worker_id, 0) + 1
    return {
        "requests": len(records),
        "prefix_hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
        "worker_prefix_hit_rate": {
            s.worker.worker_id: round(s.load.prefix_cache_hit_rate, 4) for s in workers
        },
        "requests_per_worker": per_worker,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "mean": statistics.fmean(ttft)},
        "ttft_by_cache_hit": ttft_by_hit(records),
        "latency_ms": {"p50": percentile(latency, 50), "p99": percentile(latency, 99)},
        "route_ms": {
            "p50": percentile(route, 50),
            "p99": percentile(route, 99),
            "mean": statistics.fmean(route),
        },
        "scheduler_overhead_ms": overhead.summary_ms(),
        "request_throughput": len(records) / wall_s,
        "output_throughput": sum(r.output_tokens for r in records) / wall_s,
        "prompt_tokens": prompt,
        "wall_s": wall_s,
    }


async def sample_queues(
    stub: scheduler_pb2_grpc.SchedulerStub, samples: dict[str, list[int]], interval_s: float = 0.1,
    loop: OpenLoop | None = None, timeline: list[dict[str, Any]] | None = None,
    every_s: float = 0.5,
) -> None:  # fmt: skip
    """Every `interval_s`, each worker's queue (running + waiting, from its heartbeats);
    with `loop`, every `every_s` a timeline row: those queues, the requests the client
    has in flight and the live sessions."""
    next_row = 0.0
    while True:
        queues: dict[str, int] = {}
        with contextlib.suppress(grpc.aio.AioRpcError):
            reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
            for status in reply.workers:
                queue = queues[status.worker.worker_id] = status.load.num_running + status.load.num_waiting
                samples.setdefault(status.worker.worker_id, []).append(queue)
        now = time.perf_counter() - loop.start if loop is not None else 0.0
        if loop is not None and timeline is not None and now >= next_row:
            next_row = now + every_s
            timeline.append({"t": round(now, 2), "worker_queue": queues,
                             "client_in_flight": loop.in_flight, "live_sessions": loop.live_sessions})  # fmt: skip
        await asyncio.sleep(interval_s)


def queue_balance(samples: dict[str, list[int]]) -> dict[str, Any]:
    """Time-averaged queue per worker; the busiest one over the mean of all."""
    means = {w: statistics.fmean(q) for w, q in samples.items() if q}
    overall = statistics.fmean(means.values()) if means else 0.0
    busiest = max(means.values()) if means else 0.0
    return {"mean_queue_per_worker": {w: round(m, 2) for w, m in means.items()},
            "busiest_over_mean": busiest / overall if overall else float("nan")}  # fmt: skip


async def probe_route(mesh: Mesh, records: list[Record], count: int) -> dict[str, float]:
    """Route + release back to back on the run's prompts (warm index, idle workers): the
    client-side cost of a route without admission queueing."""
    latencies = []
    for i in range(count):
        prompt = records[i % len(records)].prompt
        request = _request(prompt, 1, f"probe-{i}")
        start = time.perf_counter()
        route = await mesh.route(request, timeout=30)
        latencies.append((time.perf_counter() - start) * 1000)
        mesh.release(scheduler_pb2.ReleaseRequest(lease_ids=[route.lease_id]))
    return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99), "count": count}


def prediction_error(records: list[Record]) -> dict[str, float]:
    """Predicted (index at routing time) vs actual (worker usage) cached tokens."""
    errors = [r.cached_tokens - r.predicted_cached_tokens for r in records]
    predicted = sum(r.predicted_cached_tokens for r in records)
    actual = sum(r.cached_tokens for r in records)
    return {"predicted_tokens": predicted, "actual_tokens": actual,
            "exact_share": sum(e == 0 for e in errors) / len(errors) if errors else float("nan"),
            "over_predicted_share": sum(e < 0 for e in errors) / len(errors) if errors else float("nan")}  # fmt: skip


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


async def warm_up(mesh: Mesh, config: BenchConfig) -> None:
    """A few unrelated requests so every worker has run its first (slow) steps."""
    rng = random.Random(-1)
    prompts = [[rng.randrange(3, config.vocab) for _ in range(48)] for _ in range(2 * config.workers)]
    await asyncio.gather(*(send(mesh, p, 4, f"warmup-{i}") for i, p in enumerate(prompts)))


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


MEDIAN_KEYS = (
    ("prefix_hit_rate",),
    ("ideal_hit_rate",),
    ("policy_ms", "p50"),
    ("policy_ms", "p99"),
    ("route_probe_ms", "p50"),
    ("route_probe_ms", "p99"),
    ("route_probe_overhead_ms", "p99"),
    ("queues", "busiest_over_mean"),
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("latency_ms", "p50"),
    ("route_ms", "p50"),
    ("route_ms", "p99"),
    ("scheduler_overhead_ms", "p50"),
    ("scheduler_overhead_ms", "p99"),
    ("scheduler_overhead_ms", "mean"),
    ("request_throughput",),
    ("output_throughput",),
    # Open loop only (skipped for closed-loop runs).
    ("open_loop", "offered_request_rate"),
    ("open_loop", "achieved_request_rate"),
    ("open_loop", "zero_latency_request_rate"),
    ("open_loop", "request_rate_during_arrivals"),
    ("open_loop", "drain_s"),
    ("open_loop", "failed_requests"),
    ("open_loop", "client_in_flight", "mean"),
    ("open_loop", "client_in_flight", "max"),
    ("open_loop", "live_sessions", "mean"),
)


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median over repeated runs of the headline metrics, keyed like "ttft_ms.p50"
    (a metric missing from a run, e.g. open-loop figures of a closed loop, is left out)."""
    result: dict[str, float] = {}
    for path in MEDIAN_KEYS:
        values = []
        for run in runs:
            value: Any = run
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                values.append(float(value))
        if values and len(values) == len(runs):
            result[".".join(path)] = statistics.median(values)
    return result


def comparison(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prefix-aware against the others (medians) and the issue's targets."""
    if "prefix" not in results or "round_robin" not in results:
        return {}
    p, rr = results["prefix"]["median"], results["round_robin"]["median"]
    report: dict[str, Any] = {
        "hit_rate_prefix_over_ideal": p["prefix_hit_rate"] / p["ideal_hit_rate"],
        "hit_rate_round_robin_over_ideal": rr["prefix_hit_rate"] / p["ideal_hit_rate"],
        "ttft_p50_speedup_prefix_vs_round_robin": rr["ttft_ms.p50"] / p["ttft_ms.p50"],
        "ttft_p99_speedup_prefix_vs_round_robin": rr["ttft_ms.p99"] / p["ttft_ms.p99"],
        "throughput_ratio_prefix_over_round_robin": p["output_throughput"] / rr["output_throughput"],
    }
    if "least_load" in results:
        ll = results["least_load"]["median"]
        report["throughput_ratio_prefix_over_least_load"] = p["output_throughput"] / ll["output_throughput"]
        report["ttft_p50_speedup_prefix_vs_least_load"] = ll["ttft_ms.p50"] / p["ttft_ms.p50"]
    report["targets"] = {
        "hit_rate_ge_90pct_of_ideal": report["hit_rate_prefix_over_ideal"] >= 0.9,
        "ttft_p50_ge_2x_round_robin": report["ttft_p50_speedup_prefix_vs_round_robin"] >= 2.0,
        "throughput_ge_1_3x_round_robin": report["throughput_ratio_prefix_over_round_robin"] >= 1.3,
        "busiest_queue_within_2x_mean": p["queues.busiest_over_mean"] <= 2.0,
        "throughput_ge_least_load": report.get("throughput_ratio_prefix_over_least_load", 0.0) >= 1.0,
        "policy_p99_lt_2ms": p["policy_ms.p99"] < 2.0,
        "route_end_to_end_p99_lt_2ms": p["route_probe_ms.p99"] < 2.0,
    }
    return report


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
        from bench.routing_plot import plot_routing

        print(f"wrote {plot_routing(report, plot)}", file=sys.stderr)
    return report


if __name__ == "__main__":
    asyncio.run(main())
