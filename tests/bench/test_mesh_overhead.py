"""The paired-overhead summary of bench.mesh_overhead (pure arithmetic, no mesh)."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench import mesh_overhead
from bench.engine_bench import RunResult, Workload
from bench.mesh_overhead import summarize_pairs


def _row(system: str, c: int, tok_s: float, ttft: float = 10.0, relay: float = 0.1) -> RunResult:
    row = RunResult(system, c, 8, 512, 512 / tok_s, tok_s, {"p50": ttft}, {"p50": 1.0})
    if system != "in_process":  # CPU ms/token per process, as _paired_runs records it
        cpu = {"gateway": relay / 2, "scheduler": relay / 4, "scheduler-1": 0.0, "tokenizer": relay / 4}
        row.notes = "cpu ms/token: " + json.dumps({**cpu, "decoder-0": 1.5, "redis": 0.01, "client": 0.2})
    return row


def test_overheads_are_paired_in_run_order() -> None:
    rows = [
        _row("in_process", 32, 500.0),
        _row("mesh_si1", 32, 450.0, ttft=20.0, relay=0.3),
        _row("in_process", 32, 400.0),  # a slow period: both systems slow together
        _row("mesh_si1", 32, 396.0, ttft=13.0, relay=0.12),
        _row("in_process", 32, 520.0),
        _row("mesh_si1", 32, 520.0, ttft=11.0, relay=0.1),
    ]
    [summary] = summarize_pairs(rows, [32])
    assert summary["paired_overheads"] == pytest.approx([0.10, 0.01, 0.0])
    assert summary["overhead_median"] == pytest.approx(0.01)
    assert summary["in_process_tok_per_s_median"] == 500.0
    assert summary["mesh_tok_per_s_median"] == 450.0
    assert summary["mesh_ttft_p50_ms_median"] == 13.0
    assert summary["system"] == "mesh_si1"
    assert summary["mesh_throughput_ratio_median"] == pytest.approx(0.99)
    assert summary["ttft_p50_added_ms_median"] == pytest.approx(3.0)
    # Relays only (gateway + scheduler replicas + tokenizer): not the decoder, Redis or client.
    assert summary["relay_cpu_ms_per_token_median"] == pytest.approx(0.12)


def test_each_concurrency_is_summarized_apart() -> None:
    rows = [
        _row("in_process", 8, 300.0),
        _row("mesh_si1", 8, 150.0),
        _row("in_process", 32, 600.0),
        _row("mesh_si1", 32, 540.0),
    ]
    by_c = {s["concurrency"]: s for s in summarize_pairs(rows, [8, 32])}
    assert by_c[8]["overhead_median"] == pytest.approx(0.5)
    assert by_c[32]["overhead_median"] == pytest.approx(0.1)


def test_each_mesh_is_paired_with_the_same_in_process_runs() -> None:
    rows = [
        _row("in_process", 32, 500.0),
        _row("mesh_si1", 32, 250.0),
        _row("mesh_si8", 32, 450.0),
    ]
    by_system = {s["system"]: s for s in summarize_pairs(rows, [32])}
    assert by_system["mesh_si1"]["overhead_median"] == pytest.approx(0.5)
    assert by_system["mesh_si8"]["overhead_median"] == pytest.approx(0.1)


def test_interleaved_ttft_pairs_blocks_of_the_same_round() -> None:
    """Round r's mesh block is compared with round r's in-process block; systems run in
    a shuffled order per round, each block with its own cache salt and prompts."""
    calls: list[tuple[int, str, str, int]] = []  # (round, system, salt, first prompt token)

    def runner(system: str) -> mesh_overhead.BlockRunner:
        async def run(workload: Workload, salt: str, id_prefix: str) -> float:
            round_ = int(id_prefix[1:])
            calls.append((round_, system, salt, workload.prompts[0][0]))
            return 10.0 if system == "in_process" else 10.0 + round_  # round r: the mesh adds r ms

        return run

    systems = {"in_process": [runner("in_process")], "mesh_si1": [runner("mesh_si1")]}
    workload = Workload([[i] for i in range(16)], 4)
    report = asyncio.run(mesh_overhead.interleaved_ttft(systems, workload, rounds=7, block=2, seed=0))
    assert report["mesh_si1"]["ttft_added_ms_median"] == pytest.approx(3.0)  # median of 0..6
    assert report["mesh_si1"]["rounds_at_or_under_3ms"] == 4
    assert report["in_process_ttft_block_p50_ms_median"] == 10.0
    first_each_round = [next(s for r, s, _, _ in calls if r == round_) for round_ in range(7)]
    assert set(first_each_round) == {"in_process", "mesh_si1"}  # the order is shuffled
    assert len({salt for _, _, salt, _ in calls}) == 14  # no block reuses another's cache
    assert [p for r, s, _, p in calls if s == "mesh_si1"] == [(2 * r) % 16 for r in range(7)]


def test_interleaved_ttft_averages_the_instances_of_a_system() -> None:
    """With several instances per system, a round's value is the mean of the instances'
    block medians; every instance runs a block every round, and each is reported."""
    ttfts = {"in-0": 10.0, "in-1": 14.0, "mesh-0": 13.0, "mesh-1": 19.0, "mesh-2": 22.0}
    calls: list[tuple[int, str]] = []

    def runner(instance: str) -> mesh_overhead.BlockRunner:
        async def run(workload: Workload, salt: str, id_prefix: str) -> float:
            calls.append((int(id_prefix[1:]), instance))
            return ttfts[instance]

        return run

    systems = {
        "in_process": [runner(f"in-{i}") for i in range(2)],
        "mesh_si1": [runner(f"mesh-{i}") for i in range(3)],
    }
    workload = Workload([[i] for i in range(16)], 4)
    report = asyncio.run(mesh_overhead.interleaved_ttft(systems, workload, rounds=4, block=2, seed=0))
    assert report["instances"] == {"in_process": 2, "mesh_si1": 3}
    assert report["in_process_ttft_block_p50_ms_median"] == pytest.approx(12.0)
    assert report["in_process_instance_ttft_block_p50_ms_medians"] == [10.0, 14.0]
    assert report["mesh_si1"]["instance_ttft_block_p50_ms_medians"] == [13.0, 19.0, 22.0]
    assert report["mesh_si1"]["ttft_added_ms_median"] == pytest.approx(6.0)  # mean 18 - mean 12
    assert sorted(calls) == sorted((r, name) for r in range(4) for name in ttfts)
