"""bench.serving_overhead: each served system against its own in-process engine, round by
round, every system of a round on the same prompts (fake runners, no engine)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from bench import serving_overhead
from bench.engine_bench import Workload
from bench.serving_overhead import added_per_round, summary


def test_added_is_served_minus_its_own_in_process_per_round() -> None:
    rounds = [
        {"meshserve_inprocess": 10.0, "meshserve_mesh": 12.0, "vllm_inprocess": 7.0, "vllm_served": 15.0},
        {"meshserve_inprocess": 14.0, "meshserve_mesh": 17.0, "vllm_inprocess": 8.0, "vllm_served": 14.0},
        {"meshserve_inprocess": 11.0, "meshserve_mesh": 15.0, "vllm_inprocess": 7.5, "vllm_served": 17.5},
    ]
    assert added_per_round(rounds) == {
        "meshserve_mesh": pytest.approx([2.0, 3.0, 4.0]),
        "vllm_served": pytest.approx([8.0, 6.0, 10.0]),
    }
    result = summary(rounds)
    assert result["ttft_added_ms_median"] == pytest.approx({"meshserve_mesh": 3.0, "vllm_served": 8.0})
    assert result["ttft_p50_ms_median"]["vllm_inprocess"] == 7.5
    assert result["ttft_p50_ms_median"]["meshserve_mesh"] == 15.0


def test_rounds_run_every_system_once_on_the_same_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, str, int]] = []  # (round, system, first prompt token)
    rounds_started: list[int] = []

    def fake_workload(model_dir: str, n: int, prompt_len: int, output_len: int, seed: int) -> Workload:
        rounds_started.append(seed)
        return Workload([[seed * 100 + i] * prompt_len for i in range(n)], output_len)

    def runner(system: str, ttft_ms: float):  # type: ignore[no-untyped-def]
        async def run(args: argparse.Namespace, workload: Workload) -> list[float]:
            seen.append((rounds_started[-1], system, workload.prompts[0][0]))
            return [ttft_ms / 1000] * len(workload.prompts)

        return run

    ttfts = {"meshserve_inprocess": 10.0, "meshserve_mesh": 12.5, "vllm_inprocess": 7.0, "vllm_served": 15.0}
    monkeypatch.setattr(serving_overhead, "make_workload", fake_workload)
    monkeypatch.setattr(serving_overhead, "RUNNERS", {s: runner(s, t) for s, t in ttfts.items()})
    args = serving_overhead.parse_args(["--model-dir", "m", "--rounds", "3", "--num-requests", "4"])
    result = asyncio.run(serving_overhead.bench(args))

    assert len(seen) == 12
    for index in range(3):
        in_round = [(s, first) for r, s, first in seen if r == index]
        assert sorted(s for s, _ in in_round) == sorted(ttfts)
        assert {first for _, first in in_round} == {index * 100}  # the round's prompts, for all
    orders = [tuple(s for r, s, _ in seen if r == index) for index in range(3)]
    assert len(set(orders)) > 1  # shuffled per round
    assert result["summary"]["ttft_added_ms_median"] == pytest.approx(
        {"meshserve_mesh": 2.5, "vllm_served": 8.0}
    )

    seen.clear()
    args = serving_overhead.parse_args(
        ["--model-dir", "m", "--rounds", "1", "--num-requests", "2", "--skip-vllm"]
    )
    result = asyncio.run(serving_overhead.bench(args))
    assert sorted(s for _, s, _ in seen) == ["meshserve_inprocess", "meshserve_mesh"]
    assert result["summary"]["ttft_added_ms_median"] == pytest.approx({"meshserve_mesh": 2.5})
