"""An experiment for the GPU kit: ``x @ w.T`` for a few rows of ``x`` (a decode step's
projections) by a Triton kernel, against cuBLAS (``F.linear``).

At one to a few rows a projection's time is its weight's bytes over the memory bandwidth,
and cuBLAS's kernels for such shapes read some weights at a fraction of it (the kit's
c1_anatomy: the k/v projections of the 1.2B profile at 0.39 TB/s). The kernel splits the
weight's rows over programs (``block_n`` each) and, for short outputs, its columns too
(``split_k`` float32 partial sums, added after); rows of ``x`` are padded to 16 for the
tensor cores. The kit times it over a few configurations per shape: whether a kernel of
this kind beats cuBLAS at all decides whether the engine takes one. Not used by the engine.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

__all__ = ["CONFIGS", "HAS_TRITON", "skinny_linear"]

# (block_n, block_k, split_k) the kit tries per shape.
CONFIGS = ((16, 256, 1), (16, 512, 1), (32, 256, 1), (32, 512, 1), (16, 256, 4), (32, 256, 4), (16, 512, 8))
MAX_ROWS = 16

if HAS_TRITON:
    # fmt: off
    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _skinny_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, part_ptr, M, N, K, x_stride, w_stride,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):
        # fmt: on
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(split * BLOCK_K, K, BLOCK_K * SPLIT_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rows[:, None] * x_stride + ks[None, :],
                mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[:, None] * w_stride + ks[None, :],
                mask=(cols[:, None] < N) & (ks[None, :] < K),
                other=0.0,
            )
            acc += tl.dot(x, tl.trans(w))
        out = part_ptr + split * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def skinny_linear(
    x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int] = CONFIGS[0]
) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T`` in ``x``'s dtype, float32 accumulation, for ``M <= 16``."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k:
        raise ValueError(
            f"skinny_linear takes at most {MAX_ROWS} rows of a [N, {k}] weight, got {tuple(x.shape)}"
        )
    block_n, block_k, split_k = config
    x, w = x.contiguous(), w.contiguous()
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    launch: Any = _skinny_kernel[(triton.cdiv(n, block_n), split_k)]
    launch(
        x,
        w,
        part,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
    )
    return (part[0] if split_k == 1 else part.sum(0)).to(x.dtype)
