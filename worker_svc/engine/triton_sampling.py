"""Triton kernel for the GPU sampler: each row's top-p nucleus found on the device.

Top-p alone (no top-k) asks for the smallest set of a row's best tokens holding ``top_p``
of its mass. Sorting the vocabulary finds it without the host but costs a segmented sort
of every row; taking the best few candidates costs little but must ask whether they hold
the nucleus, and that answer reaches the host only by waiting for the step
(docs/design-decisions.md, "Top-p without waiting for the device").

``nucleus_thresholds`` instead searches, per row, the smallest logit of the nucleus:
the largest ``t`` whose tokens at or above it hold ``top_p`` of the row's mass (so tokens
tied with the nucleus's last one are kept, whatever their ids). One program per row; a
first pass over the row takes its maximum and its softmax denominator, then each pass
weighs the row's mass at or above ``NUCLEUS_WAYS`` cut points spread over the bracket
still holding the answer. The cut points are 32-bit order-preserving keys of float32
logits, so ``NUCLEUS_PASSES`` passes of 16 ways end on the exact logit, whatever the
logits' range.

Import-safe without triton (``HAS_TRITON`` is then False and ``serves`` says no).
"""

from __future__ import annotations

from typing import Any

import torch

from worker_svc.engine.triton_attention import HAS_TRITON, interpreting, tl, triton

__all__ = ["NUCLEUS_PASSES", "NUCLEUS_WAYS", "nucleus_thresholds", "serves"]

NUCLEUS_WAYS = 16  # cut points weighed per pass: 4 of the key's 32 bits
NUCLEUS_PASSES = 8  # 16**8 = 2**32: the bracket shrinks to the one exact key
_BLOCK = 512  # logits per tile: [_BLOCK, NUCLEUS_WAYS] comparisons per tile
_WARPS = 4


def serves(logits: torch.Tensor) -> bool:
    """Whether the kernel can take these logits (float32 on a GPU, or on CPU under
    Triton's interpreter)."""
    dev = logits.device.type
    on_device = dev == "cuda" or (dev == "cpu" and interpreting())
    return HAS_TRITON and on_device and logits.dtype == torch.float32


if HAS_TRITON:

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _order_key(bits):  # type: ignore[no-untyped-def]
        """float32 bits (as int32) <-> an int32 ordered as the floats are: a negative
        float's magnitude bits flipped. Its own inverse (the sign bit is kept)."""
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _nucleus_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, top_p_ptr, out_ptr, vocab, row_stride,
        BLOCK: tl.constexpr, WAYS: tl.constexpr, PASSES: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        offs = tl.arange(0, BLOCK)
        top_p = tl.load(top_p_ptr + row)
        # Pass 1: the row's maximum and softmax denominator (online, as key_tile's).
        m = tl.full((), -float("inf"), tl.float32)
        z = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < vocab, other=-float("inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)  # all -inf so far: no NaN
            z = z * tl.exp(m - m_sub) + tl.sum(tl.exp(x - m_sub), axis=0)
            m = m_new
        target = top_p * z
        m_sub = tl.where(m == -float("inf"), 0.0, m)
        # Invariant: mass(keys >= lo) >= target > mass(keys >= hi). lo starts at -inf's key
        # (all the mass: if rounding says otherwise every token stays), hi past the max's.
        lo = tl.full((), -2139095041, tl.int64)  # the key of -inf (bits 0xFF800000)
        hi = _order_key(m.to(tl.int32, bitcast=True)).to(tl.int64) + 1
        ways = tl.arange(0, WAYS).to(tl.int64)
        for _ in range(PASSES):
            width = hi - lo
            cuts = (lo + width * ways // WAYS).to(tl.int32)  # cuts[0] == lo
            mass = tl.zeros((WAYS,), tl.float32)
            for start in range(0, vocab, BLOCK):
                x = tl.load(base + start + offs, mask=start + offs < vocab, other=-float("inf"))
                keys = _order_key(x.to(tl.int32, bitcast=True))
                above = keys[:, None] >= cuts[None, :]
                mass += tl.sum(tl.where(above, tl.exp(x - m_sub)[:, None], 0.0), axis=0)
            best = tl.max(tl.where(mass >= target, ways, 0), axis=0)  # last cut still holding it
            lo, hi = lo + width * best // WAYS, lo + width * (best + 1) // WAYS
        thr = _order_key(lo.to(tl.int32)).to(tl.float32, bitcast=True)
        # top_p >= 1 keeps the whole row (rounding could trim its tail).
        tl.store(out_ptr + row, tl.where(top_p >= 1.0, -float("inf"), thr))


def nucleus_thresholds(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits [rows, vocab]`` (float32), the smallest logit of its top-p
    nucleus (``top_p [rows]``, float32, on the same device): the tokens with logits at or
    above it are the nucleus, ties with its last token included; -inf for ``top_p >= 1``.
    Nothing is read back to the host."""
    if not serves(logits):
        raise ValueError("nucleus_thresholds takes float32 logits on a GPU (or under TRITON_INTERPRET=1)")
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        launch: Any = _nucleus_kernel[(rows,)]
        launch(
            logits, top_p, out, vocab, logits.stride(0),
            BLOCK=_BLOCK, WAYS=NUCLEUS_WAYS, PASSES=NUCLEUS_PASSES, num_warps=_WARPS,
        )  # fmt: skip
    return out
