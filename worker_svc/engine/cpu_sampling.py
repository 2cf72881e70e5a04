"""Native CPU draw of one token per row (``csrc/sample_rows.c``), called through ctypes.

It computes what :func:`worker_svc.engine.sampling._probs` + ``_inverse_cdf`` do with torch
ops, two passes over each row instead of about ten over the whole matrix
(docs/design-decisions.md, "The unseeded draw in a native kernel on CPU"). Optional like
the other native kernels: :func:`load` returns None without them and the sampler keeps
torch.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from worker_svc.engine import native
from worker_svc.engine.native import DTYPE_CODES, I64, PTR

__all__ = ["RowSampler", "load"]


class RowSampler:
    """Callable wrapper of ``meshserve_sample_rows`` (float32 and bfloat16 logits)."""

    dtypes = frozenset(DTYPE_CODES)

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.meshserve_sample_rows
        fn.restype = ctypes.c_int
        fn.argtypes = [PTR, ctypes.c_int, I64, I64, I64, PTR, PTR, PTR, PTR]
        self._fn = fn

    def __call__(
        self, logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor, u: torch.Tensor
    ) -> torch.Tensor:
        """Column drawn per row of ``logits [rows, cols]`` (CPU, columns contiguous).

        Row ``b`` weighs column ``c`` by ``exp(x - max x)`` where ``x = scale[b] * logits[b, c]``,
        0 where ``x`` lies more than ``floor[b]`` below the row's largest (or is -inf); the
        column is the first whose running weight exceeds ``u[b]`` times the row's total
        (``u`` in [0, 1)). ``scale``, ``floor`` and ``u`` are float32 ``[rows]``.
        """
        rows, cols = logits.shape
        if logits.device.type != "cpu" or logits.dtype not in DTYPE_CODES or logits.stride(1) != 1:
            raise ValueError("row sampling needs CPU float32/bfloat16 logits with contiguous columns")
        args = [t.to(torch.float32).contiguous() for t in (scale, floor, u)]
        if any(t.shape != (rows,) for t in args):
            raise ValueError(f"scale, floor and u must have shape [{rows}]")
        out = torch.empty(rows, dtype=torch.long)
        status = self._fn(
            logits.data_ptr(), DTYPE_CODES[logits.dtype], rows, cols, logits.stride(0),
            args[0].data_ptr(), args[1].data_ptr(), args[2].data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("row sampling: could not allocate the row buffers")
        return out


@functools.cache
def load() -> RowSampler | None:
    """The built kernel, or None when it cannot be built here."""
    lib = native.library()
    return None if lib is None else RowSampler(lib)
