"""Native CPU paged-decode attention (``csrc/paged_decode.c``) built with the system C
compiler and called through ctypes.

Why not the torch path for decode: it gathers every sequence's blocks into a padded
``[B, max_len, Hkv, D]`` copy and runs one masked SDPA over it; on CPU that copy and the
padded softmax dominate a large batch's step (docs/design-decisions.md, "CPU decode
attention on torch's OpenMP threads"). The kernel reads K/V in place through the block
table, each sequence only up to its own length.

bf16 plain causal layers are computed with the rounding of PyTorch's CPU flash kernel, so
the result equals ``F.scaled_dot_product_attention`` over the sequence's keys bit for bit
(what transformers' sdpa attention computes at a decode step: greedy bf16 parity with
``generate``); see :func:`exact_bf16_verified` for where that is verified.

Optional: without a compiler (or when the build fails, see :mod:`native`) :func:`load`
returns None and the runner keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from worker_svc.engine import native
from worker_svc.engine.native import DTYPE_CODES, I64, PTR

__all__ = ["DecodeKernel", "exact_bf16_verified", "load"]


class DecodeKernel:
    """Callable wrapper of ``meshserve_paged_decode`` (float32 and bfloat16 caches)."""

    dtypes = frozenset(DTYPE_CODES)

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.meshserve_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [PTR, I64, I64, PTR, I64, PTR, I64, PTR, PTR, PTR, I64, I64]
        fn.argtypes += [I64] * 5 + [ctypes.c_float, ctypes.c_int]
        fn.argtypes += [I64, ctypes.c_float, PTR]  # window, softcap, sinks
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        rows: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Attention of ``q[rows[b]]`` (``q/out [T, H, D]``) over sequence ``b``; writes ``out[rows[b]]``.

        ``cache [2, nb, bs, Hkv, D]`` contiguous; ``block_tables [B, max_blocks]`` and
        ``seq_lens [B]`` int32, ``rows [B]`` int64, all contiguous on CPU. ``window``
        (keys ``p - window < k <= p``), ``softcap`` and ``sinks`` (``[H]``) as the
        attention module describes; 0 / 0.0 / None mean none.
        """
        _, nb, bs, hkv, d = cache.shape
        heads = q.shape[1]
        if q.stride(2) != 1 or out.stride(2) != 1 or not cache.is_contiguous():
            raise ValueError("paged decode needs d-contiguous q/out and a contiguous cache")
        if q.dtype != cache.dtype or out.dtype != cache.dtype or cache.dtype not in DTYPE_CODES:
            raise ValueError(f"paged decode supports {sorted(map(str, DTYPE_CODES))} only")
        sink_f32 = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
        if sink_f32 is not None and sink_f32.shape != (heads,):
            raise ValueError(f"sinks must have shape [{heads}], got {list(sink_f32.shape)}")
        status = self._fn(
            q.data_ptr(), q.stride(0), q.stride(1), cache.data_ptr(), nb,
            block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), rows.data_ptr(),
            out.data_ptr(), out.stride(0), out.stride(1),
            rows.shape[0], heads, hkv, d, bs, scale, DTYPE_CODES[cache.dtype],
            window, softcap, None if sink_f32 is None else sink_f32.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("paged decode: could not allocate the score buffer")


def exact_bf16_verified(flags: frozenset[str]) -> bool:
    """Whether the bf16 decode is known to equal PyTorch's CPU SDPA bit for bit on a CPU
    with these feature flags: the kernel reproduces oneDNN's bf16 gemv order as run on
    avx512_bf16 without AMX (torch 2.13, oneDNN 3.12; test_cpu_attention_exact.py).
    Elsewhere the kernel is as accurate, but its rounding may differ from SDPA's."""
    return "avx512_bf16" in flags and "amx_bf16" not in flags


@functools.cache
def load() -> DecodeKernel | None:
    """The built kernel, or None when it cannot be built here (``--attention-backend torch``
    keeps an engine off it)."""
    lib = native.library()
    return None if lib is None else DecodeKernel(lib)
