"""routing_bench's workload: a run's settings (BenchConfig), the seeded multi-turn
conversations and their KV working set (what the caches are sized on), and the open loop's
seeded schedule of session arrivals and think times."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any

from services.kv_hash import block_hashes


@dataclass(frozen=True)
class BenchConfig:
    """One run's settings; every field is a `routing_bench` flag (`--field-name`)."""

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
    """A shared system prompt and the user turns that follow it, as token ids."""

    system: tuple[int, ...]
    turns: tuple[tuple[int, ...], ...]


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
