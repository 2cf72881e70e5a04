"""The GPU kit (bench/gpu) dry run on CPU: the same steps with tiny shapes, so the kit
cannot rot before a GPU host runs it. CUDA-only parts (graphs) are skipped with a reason;
every step that runs must leave real figures in the JSON."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.gpu.context import PROFILES
from bench.gpu.kit import HANG_STEP_ENV, STEPS, run_kit
from bench.gpu.steps import ARCHS

DRY = PROFILES["cpu-dry-run"]


def _rows_ok(rows: list[dict], concurrencies: tuple[int, ...]) -> None:
    assert [r["concurrency"] for r in rows] == list(concurrencies)
    for row in rows:
        assert row["output_tokens"] == DRY.num_requests(row["concurrency"]) * DRY.output_len
        assert row["output_tok_per_s"] > 0 and row["tpot_ms"]["p50"] > 0 and row["ttft_ms"]["p50"] > 0


def test_dry_run_leaves_every_figure(tmp_path: Path) -> None:
    steps = [s for s in STEPS if s != "mesh"]  # the mesh's five processes: test_dry_run_mesh (slow)
    run_kit(DRY, tmp_path / "work", tmp_path / "gpu.json", steps, inline=True)
    report = json.loads((tmp_path / "gpu.json").read_text())
    got = report["steps"]
    assert {name: got[name]["status"] for name in steps} == {
        "build": "ok",
        "correctness": "ok",
        "roofline": "ok",
        "decode_attention": "skipped",
        "engine_graphs": "skipped",
        "engine_eager": "ok",
        "lora_mix": "ok",
        "hf_naive": "ok",
        "c1_anatomy": "ok",
        "host_overhead": "ok",
        "skinny_gemm": "skipped",
        "prefill_attention": "skipped",
        "norm_parity": "skipped",
        "top_p_sampler": "skipped",
    }, {name: got[name].get("error") for name in steps}
    cuda_only = (
        "engine_graphs",
        "decode_attention",
        "skinny_gemm",
        "prefill_attention",
        "norm_parity",
        "top_p_sampler",
    )
    for name in cuda_only:
        assert "CUDA" in got[name]["reason"], name
    assert set(got["correctness"]["archs"]) == set(ARCHS) and got["correctness"]["all_match"] is True
    for case in got["correctness"]["archs"].values():
        assert case["eager"]["match"] and "CUDA" in case["graphs"]["skipped"]
    roof = got["roofline"]
    assert roof["copy_read_write_gb_per_s"] > 0
    assert got["build"]["weight_bytes"] <= roof["weight_bytes"] < got["build"]["weight_bytes"] * 1.01
    _rows_ok(got["engine_eager"]["rows"], DRY.concurrencies)
    for row in got["engine_eager"]["rows"]:  # every step eager, each timed
        assert list(row["steps"]) == ["eager"] and row["steps"]["eager"]["p50_ms"] > 0
        assert row["steps"]["eager"]["steps"] >= DRY.output_len
    lora = got["lora_mix"]
    for label in ("base_lora_on", "mix"):
        assert lora[label]["output_tokens"] == DRY.num_requests(DRY.mesh_concurrency) * DRY.output_len
    assert lora["cuda_graphs"]["disabled"] == "cuda_graphs off"  # no CUDA: the config asks for none
    assert got["hf_naive"]["row"]["output_tokens"] == DRY.naive_requests * DRY.output_len
    # CPU: no replay, no kernels; the host profile, and the merged engine's tokens equal.
    anatomy = got["c1_anatomy"]["variants"]
    assert list(anatomy) == ["graphs", "merged"] and anatomy["graphs"]["kernels"] is None
    assert anatomy["merged"]["tokens_equal_default"] is True and anatomy["merged"]["graph_replay_ms"] is None
    assert anatomy["graphs"]["decode_step_ms_p50"] > 0 and len(anatomy["graphs"]["tokens"]) == DRY.output_len
    assert any(
        "forward" in row["fn"] and row["own_us_per_step"] > 0 for row in anatomy["graphs"]["host_profile"]
    )
    summary = report["summary"]
    assert set(summary["host_ms_per_step"]) == {
        f"c{c}_{path}host_ms_per_step"
        for c in DRY.host_concurrencies
        for path in ("", "graph_", "penalized_graph_")
    }
    assert all(ms > 0 for ms in summary["host_ms_per_step"].values())
    assert summary["correctness_all_match"] is True
    assert summary["lora_mix_over_base_tok_s"] > 0 and summary["lora_mix_tokens_equal_eager"] is True
    assert summary["c1_tpot_over_roofline_eager"] > 0 and summary["c1_engine_over_hf_naive_tok_s"] > 0
    # float32 on CPU: the engine's greedy tokens are transformers' (the comparison works).
    assert summary["c1_first_diff_vs_hf_naive"] == [None] * DRY.naive_requests
    assert report["env"]["commit"] and report["env"]["packages"]["torch"] != "absent"
    assert report["profile"]["name"] == "cpu-dry-run"


def test_isolated_steps_record_failures_and_time_boxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Build hangs (injected) in its own process and is killed at its one-second box; so no
    # model is built, and roofline fails in its own process. Both leave a record, and the
    # JSON is written.
    monkeypatch.setenv(HANG_STEP_ENV, "build")
    boxed = replace(DRY, step_s={**DRY.step_s, "build": 1})
    run_kit(boxed, tmp_path / "work", tmp_path / "gpu.json", ["build", "roofline"])
    got = json.loads((tmp_path / "gpu.json").read_text())["steps"]
    assert got["build"]["status"] == "timeout" and "time box" in got["build"]["error"]
    assert got["roofline"]["status"] == "failed"
    assert "no bench model" in got["roofline"]["error"] and "no bench model" in got["roofline"]["log_tail"]


@pytest.mark.slow
def test_dry_run_mesh(tmp_path: Path) -> None:
    run_kit(DRY, tmp_path / "work", tmp_path / "gpu.json", ["build", "engine_eager", "mesh"], inline=True)
    report = json.loads((tmp_path / "gpu.json").read_text())
    mesh = report["steps"]["mesh"]
    assert mesh["status"] == "ok", mesh.get("error")
    _rows_ok([mesh["row"]], (DRY.mesh_concurrency,))
    assert report["summary"]["served_over_in_process_tok_s"] > 0
    assert report["summary"]["served_ttft_ms"]["p99"] >= report["summary"]["served_ttft_ms"]["p50"] > 0
    cores = report["summary"]["served_process_cores"]
    assert {"gateway", "tokenizer", "scheduler", "decoder-0", "client"} <= set(cores), cores
    # /proc counts CPU in ticks (10 ms): on a run this short any process may show none.
    assert all(v >= 0 for v in cores.values()), cores
    # Then four gateway processes on one port (the kernel spreads the client's few
    # connections over them: not necessarily over all four), each measured.
    more = mesh["row_more_gateways"]
    _rows_ok([more], (DRY.mesh_concurrency,))
    assert more["system"] == "mesh_g4" and report["summary"]["served_more_gateways_over_in_process_tok_s"] > 0
    assert {"gateway", "gateway-1", "gateway-2", "gateway-3"} <= set(more["process_cores"])
