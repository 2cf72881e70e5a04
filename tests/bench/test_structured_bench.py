"""`bench.structured_bench` (the per-step cost of structured outputs behind
bench/results/structured.json) runs end to end on the tiny model and writes every row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bench import structured_bench


def test_structured_bench_writes_every_row(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "structured.json"
    argv = ["structured_bench", "--tokenizer-dir", str(model_dir), "--batch", "2", "--steps", "4"]
    monkeypatch.setattr(sys, "argv", [*argv, "--repeats", "1", "--out", str(out)])
    threads = torch.get_num_threads()
    try:
        structured_bench.main()
    finally:
        torch.set_num_threads(threads)  # main() pins torch to one thread
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"unconstrained", "half_constrained", "constrained"}
    for row in result["rows"].values():
        assert row["steps"] > 0 and row["step_median_ms"] > 0
    assert result["rows"]["unconstrained"]["overhead_vs_unconstrained_ms"] == 0
