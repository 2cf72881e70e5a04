"""routing_bench's open loop: Poisson session arrivals, turns one after another, the
offered vs achieved load; and the plot's rate axis."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import grpc
import pytest

from bench import routing_client
from bench.routing_client import run_session
from bench.routing_metrics import Record, medians, open_loop_summary
from bench.routing_plot import routing_series
from bench.routing_workload import BenchConfig, OpenLoop, build_workload, open_loop_schedule


def config(**overrides: Any) -> BenchConfig:
    base = BenchConfig(model_dir="", conversations=2, turns=3, system_len=32, user_len=8, max_tokens=2)
    return BenchConfig(**{**base.__dict__, **overrides})


def test_arrivals_are_poisson_at_the_rate_and_the_same_for_every_policy() -> None:
    schedule = open_loop_schedule(config(session_rate=4.0), 2000)
    gaps = [b - a for a, b in zip(schedule.arrivals, schedule.arrivals[1:], strict=False)]
    assert schedule.arrivals[0] == 0.0 and min(gaps) >= 0.0
    assert 0.23 < statistics.fmean(gaps) < 0.27  # 1 / rate
    # Exponential gaps: the standard deviation equals the mean (a fixed pace would give 0).
    assert 0.8 < statistics.stdev(gaps) / statistics.fmean(gaps) < 1.2
    assert open_loop_schedule(config(session_rate=4.0), 2000).arrivals == schedule.arrivals
    assert all(t == 0.0 for row in schedule.think for t in row)  # no think time by default
    thinking = open_loop_schedule(config(session_rate=4.0, think_time=0.5), 10)
    assert all(row[0] == 0.0 and row[1] > 0.0 for row in thinking.think)


def fake_record(prompt: list[int]) -> Record:
    return Record(0.01, 0.02, len(prompt), 0, 2, 0.0, "w", time.perf_counter(), tuple(prompt), (1, 2))


def test_a_session_sends_its_turns_one_after_another_on_the_growing_history(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = config(session_rate=1.0)
    workload = build_workload(cfg)
    prompts: dict[int, list[list[int]]] = {0: [], 1: []}
    in_flight_seen: list[int] = []
    loop = OpenLoop(arrivals=[0.0, 0.0], think=[[0.0] * 3, [0.0] * 3])

    async def send(
        mesh: Any, prompt: list[int], max_tokens: int, request_id: str
    ) -> tuple[Record, list[int]]:
        session = int(request_id.split("-")[0][1:])
        prompts[session].append(list(prompt))
        in_flight_seen.append(loop.in_flight)
        await asyncio.sleep(0)
        return fake_record(list(prompt)), [1, 2]

    monkeypatch.setattr(routing_client, "send", send)
    records: list[Record] = []

    async def run() -> None:
        loop.start = time.perf_counter()
        await asyncio.gather(*(run_session(None, c, i, cfg, loop, records) for i, c in enumerate(workload)))  # type: ignore[arg-type]

    asyncio.run(run())
    assert len(records) == 6 and loop.live_sessions == 0 and loop.in_flight == 0
    for session, conv in enumerate(workload):
        sent = prompts[session]
        assert sent[0] == list(conv.system) + list(conv.turns[0])
        for turn in (1, 2):  # previous prompt + its answer + the next user turn
            assert sent[turn] == sent[turn - 1] + [1, 2] + list(conv.turns[turn])
    assert max(in_flight_seen) == 2  # both sessions' requests were out at once


def test_a_rejected_request_ends_its_session_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(session_rate=1.0)
    calls: list[str] = []

    async def send(
        mesh: Any, prompt: list[int], max_tokens: int, request_id: str
    ) -> tuple[Record, list[int]]:
        calls.append(request_id)
        if request_id.endswith("t1"):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "full"
            )
        return fake_record(list(prompt)), [1, 2]

    monkeypatch.setattr(routing_client, "send", send)
    loop = OpenLoop(arrivals=[0.0], think=[[0.0] * 3], start=time.perf_counter())
    records: list[Record] = []
    asyncio.run(run_session(None, build_workload(cfg)[0], 0, cfg, loop, records))  # type: ignore[arg-type]
    assert calls == ["s0-t0", "s0-t1"] and len(records) == 1
    assert (loop.failed, loop.in_flight, loop.live_sessions) == (1, 0, 0)


def test_open_loop_summary_offered_vs_achieved() -> None:
    cfg = config(session_rate=2.0, turns=5)
    loop = OpenLoop(arrivals=[0.0, 1.0, 2.0], think=[], start=100.0)
    # Two requests finish inside the 2 s arrival span, one after it.
    records = [Record(0.1, 0.5, 10, 0, 2, 0.0, "w", 100.0 + s, (), ()) for s in (0.5, 1.0, 2.0)]
    timeline = [{"client_in_flight": n, "live_sessions": n} for n in (0, 2, 4)]
    summary = open_loop_summary(cfg, loop, records, 4.0, timeline)
    assert summary["offered_request_rate"] == 10.0
    assert summary["achieved_request_rate"] == 3 / 4.0
    assert summary["request_rate_during_arrivals"] == 2 / 2.0
    assert summary["drain_s"] == 2.0
    assert summary["client_in_flight"] == {"mean": 2.0, "max": 4}


def run_result(ttft: float, open_loop: bool) -> dict[str, Any]:
    run: dict[str, Any] = {
        "prefix_hit_rate": 0.5, "ideal_hit_rate": 0.6, "policy_ms": {"p50": 0.1, "p99": 0.2},
        "route_probe_ms": {"p50": 1.0, "p99": 1.5}, "route_probe_overhead_ms": {"p99": 0.3},
        "queues": {"busiest_over_mean": 1.1}, "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
        "latency_ms": {"p50": ttft}, "route_ms": {"p50": 1.0, "p99": 2.0},
        "scheduler_overhead_ms": {"p50": 0.1, "p99": 0.2, "mean": 0.1},
        "request_throughput": 10.0, "output_throughput": 40.0,
    }  # fmt: skip
    if open_loop:
        run["open_loop"] = {
            "offered_request_rate": 15.0, "achieved_request_rate": ttft / 10, "request_rate_during_arrivals": 14.0,
            "drain_s": 1.0, "failed_requests": 0, "client_in_flight": {"mean": 3.0, "max": 9},
            "live_sessions": {"mean": 4.0},
        }  # fmt: skip
    return run


def test_medians_take_open_loop_figures_only_from_open_loop_runs() -> None:
    closed = medians([run_result(100.0, False), run_result(300.0, False)])
    assert closed["ttft_ms.p50"] == 200.0 and "open_loop.achieved_request_rate" not in closed
    opened = medians([run_result(100.0, True), run_result(300.0, True), run_result(200.0, True)])
    assert opened["open_loop.achieved_request_rate"] == 20.0
    assert opened["open_loop.client_in_flight.mean"] == 3.0


def test_plot_puts_rate_reports_on_the_offered_request_rate_axis() -> None:
    def point(ttft: float) -> dict[str, Any]:
        return {"median": medians([run_result(ttft, True)])}

    report = {
        "config": {"turns": 5},
        "results": {"rate=4": {"prefix": point(400.0)}, "rate=2": {"prefix": point(200.0)}},
    }
    series = routing_series(report)["prefix"]
    assert series["x"] == [10.0, 20.0]  # sessions/s x turns, ascending
    assert series["ttft_ms.p50"] == [200.0, 400.0]
    assert series["open_loop.achieved_request_rate"] == [20.0, 40.0]
    closed = {"results": {"c=32": {"prefix": point(1.0)}, "c=8": {"prefix": point(2.0)}}}
    assert routing_series(closed)["prefix"]["x"] == [8, 32]


def test_zero_latency_rate_is_the_schedule_served_instantly() -> None:
    from bench.routing_workload import zero_latency_request_rate

    cfg = config(session_rate=4.0, turns=5)
    last = open_loop_schedule(cfg, 200).arrivals[-1]
    assert zero_latency_request_rate(cfg, 200) == 200 * 5 / last  # close to 4 x 5 requests/s
    thinking = config(session_rate=4.0, turns=5, think_time=2.0)
    assert zero_latency_request_rate(thinking, 200) < 200 * 5 / last  # the last turns come later


def test_duration_sets_the_sessions_per_rate() -> None:
    from bench.routing_workload import session_count

    assert session_count(config(duration=30.0), 2.5) == 75
    assert session_count(config(sessions=40), 2.5) == 40
    assert session_count(config(), 2.5) == 2  # conversations
