"""The GPU kit's prefill_attention step (bench.gpu.steps) on a small profile: a mixed
step's attention on the triton backend (decode rows, a fresh prompt, a continued chunk) with
its prompt chunks attended one SDPA call each equals the one launch. Checked on CPU through
Triton's interpreter (run by tests/worker_engine/test_triton_interpret.py)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
import torch

from bench.gpu import steps
from bench.gpu.context import PROFILES

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1 (test_triton_interpret.py runs it so)",
)


def test_the_kits_step_compares_the_per_chunk_path_with_one_launch() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    profile = replace(PROFILES["cpu-dry-run"], device=device)
    calls = []

    def once(fn: Any, n: int) -> float:
        calls.append(fn())
        return 1.0

    row = steps._prefill_attention_row(profile, [(20, 1), (0, 19), (33, 1), (40, 24)], timer=once)
    assert row["sequences"] == 4 and row["tokens"] == 45
    assert len(calls) == 1 + len(row["one_launch_us_by_block_q"])
    assert row["max_abs_diff"] < 1e-5  # float32: equal up to summation order
