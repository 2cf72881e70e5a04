"""Runs the Triton kernel tests on CPU through Triton's interpreter when no GPU is here.

TRITON_INTERPRET must be set before triton compiles the kernels, so the kernel tests
run in a child pytest with the variable set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker_svc.engine import triton_attention

ROOT = Path(__file__).resolve().parents[2]


# Every test of the Triton kernels: their own, and the engine's through them (windowed
# layers, CUDA graphs' replay), in one child (one interpreter start for all of them).
TRITON_TESTS = [
    "tests/worker_engine/test_triton_attention.py",
    "tests/worker_engine/test_triton_layers.py",
    "tests/worker_engine/test_triton_sampling.py",
    "tests/worker_engine/test_arch_matrix.py::test_windowed_layers_on_the_triton_backend",
    "tests/worker_engine/test_arch_matrix.py::test_triton_backend_matches_transformers",
    "tests/worker_engine/test_cuda_graphs.py::test_windowed_model_replays_like_eager[triton]",
    "tests/bench/test_skinny_gemm.py",  # the GPU kit's skinny-GEMM experiment
    "tests/bench/test_prefill_attention.py",  # the GPU kit's prefill-attention step
    "tests/bench/test_top_p_sampler.py",  # the GPU kit's top-p sampler step
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs natively on the GPU instead")
@pytest.mark.skipif(not triton_attention.HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_match_torch_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TRITON_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, summary
