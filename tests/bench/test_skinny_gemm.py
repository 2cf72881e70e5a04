"""The GPU kit's skinny-GEMM experiment computes ``x @ w.T``: checked on CPU through Triton's
interpreter (float32 and float16: the interpreter multiplies bfloat16 wrongly; run by
tests/worker_engine/test_triton_interpret.py), every configuration the kit times, rows
from one to the most it takes, split and unsplit."""

from __future__ import annotations

import os

import pytest
import torch

from bench.gpu import skinny_gemm


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1 (test_triton_interpret.py runs it so)",
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
