"""The GPU kit's top_p_sampler step (bench.gpu.steps) at a small size: each of the
sampler's top-p paths is timed on the same batch, and the nuclei found on the device equal
the sort's. Checked on CPU through Triton's interpreter (run by
tests/worker_engine/test_triton_interpret.py)."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import pytest
import torch

from bench.gpu import steps
from worker_svc.engine import sampling

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1 (test_triton_interpret.py runs it so)",
)


def _spy(taken: list[str], label: str, real: Any, *args: Any) -> Any:
    taken.append(label)
    return real(*args)


def test_the_kits_step_times_each_top_p_path(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    taken: list[str] = []
    for owner, name, label in (
        (sampling.triton_sampling, "draw", "kernel"),
        (sampling.triton_sampling, "nucleus_thresholds", "thresholds"),
        (sampling, "_nucleus_candidates", "candidates"),
    ):
        monkeypatch.setattr(owner, name, partial(_spy, taken, label, getattr(owner, name)))
    timed: list[str] = []

    def once(fn: Any, n: int) -> float:
        taken.clear()
        fn()
        timed.append("+".join(taken) or "-")
        return 1.0

    row = steps._top_p_sampler_row(sampling.TOP_K_FAST_MAX + 100, 3, device, timer=once)
    # Top-p by the draw kernel (unseeded rows), the candidates, the sort; then rows at a
    # temperature alone by the kernel and by torch (on CPU both by the native draw).
    plain = "kernel" if device.type == "cuda" else "-"
    assert timed == ["kernel", "candidates", "-", plain, "-"]
    assert row["draws_outside_nucleus"] == 0 and row["plain_draws_differing_from_torch"] == 0
    assert {f"{path}_us" for path in steps.TOP_P_PATHS} <= row.keys()
    assert {"plain_kernel_us", "plain_torch_us"} <= row.keys()
    assert row["rows_differing_from_sort"] == 0
