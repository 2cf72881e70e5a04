"""The GPU kit's top_p_sampler step (bench.gpu.steps) at a small size: each of the
sampler's top-p paths is timed on the same batch, and the nuclei found on the device equal
the sort's. Checked on CPU through Triton's interpreter (run by
tests/worker_engine/test_triton_interpret.py)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from bench.gpu import steps
from worker_svc.engine import sampling

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1 (test_triton_interpret.py runs it so)",
)


def test_the_kits_step_times_each_top_p_path(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    taken: list[str] = []
    real_search, real_candidates = sampling.triton_sampling.nucleus_thresholds, sampling._nucleus_candidates

    def search(*args: Any) -> torch.Tensor:
        taken.append("device")
        return real_search(*args)

    def candidates(*args: Any) -> Any:
        taken.append("candidates")
        return real_candidates(*args)

    monkeypatch.setattr(sampling.triton_sampling, "nucleus_thresholds", search)
    monkeypatch.setattr(sampling, "_nucleus_candidates", candidates)
    timed: list[str] = []

    def once(fn: Any, n: int) -> float:
        taken.clear()
        fn()
        timed.append("+".join(taken) or "sort")
        return 1.0

    row = steps._top_p_sampler_row(sampling.TOP_K_FAST_MAX + 100, 3, device, timer=once)
    assert timed == list(steps.TOP_P_PATHS)
    assert {f"{path}_us" for path in steps.TOP_P_PATHS} <= row.keys()
    assert row["rows_differing_from_sort"] == 0
