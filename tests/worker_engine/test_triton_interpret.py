"""Runs the Triton kernel tests on CPU through Triton's interpreter when no GPU is here.

TRITON_INTERPRET must be set before triton compiles the kernels, so the kernel tests
run in a child pytest with the variable set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from tests import head_start
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


CHILD_TIMEOUT_S = 600


def _run_child() -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TRITON_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )


# Where the test runs, the child runs beside the other tests from the session's start
# (tests/head_start.py).
if not torch.cuda.is_available() and triton_attention.HAS_TRITON:
    head_start.register("interpreted_kernel_tests", lambda: nullcontext(_run_child()))


@pytest.fixture
def interpreted_kernel_tests() -> subprocess.CompletedProcess[str]:
    return head_start.take("interpreted_kernel_tests", timeout=CHILD_TIMEOUT_S)  # type: ignore[no-any-return]


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs natively on the GPU instead")
@pytest.mark.skipif(not triton_attention.HAS_TRITON, reason="triton is not installed")
@pytest.mark.timeout(CHILD_TIMEOUT_S + 60)
def test_triton_kernels_match_torch_under_interpreter(
    interpreted_kernel_tests: subprocess.CompletedProcess[str],
) -> None:
    result = interpreted_kernel_tests
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, summary
