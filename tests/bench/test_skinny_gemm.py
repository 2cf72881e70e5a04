"""The GPU kit's skinny-GEMM experiment computes ``x @ w.T``: checked on CPU through Triton's
interpreter (float32 and float16: the interpreter multiplies bfloat16 wrongly), every
configuration the kit times, rows from one to the most it takes, split and unsplit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import skinny_gemm

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not skinny_gemm.HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs natively on the GPU instead")
def test_skinny_linear_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_skinny_linear_equals_matmul",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1 (test_skinny_linear_under_the_interpreter runs it so)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_linear_equals_matmul(dtype: torch.dtype) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    for rows, n, k in ((1, 48, 512), (3, 40, 1024), (16, 64, 768)):
        x = torch.randn(rows, k, generator=gen).to(device, dtype)
        w = torch.randn(n, k, generator=gen).to(device, dtype)
        want = x.float() @ w.float().T
        for config in skinny_gemm.CONFIGS:
            got = skinny_gemm.skinny_linear(x, w, config)
            assert got.dtype == dtype and got.shape == (rows, n)
            tol = 1e-3 if dtype == torch.float32 else 0.25
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=tol, msg=str((rows, n, k, config)))
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_gemm.skinny_linear(
            torch.zeros(17, 16, device=device, dtype=dtype), torch.zeros(8, 16, device=device, dtype=dtype)
        )
