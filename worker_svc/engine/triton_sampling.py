"""Triton kernels for the GPU sampler: a row's draw, and its top-p nucleus, on the device.

``draw`` draws one token per row by inverse CDF (one uniform per row, from torch's
generator) from softmax(logits / temperature), tokens further below the row's best than
its floor weighing 0 (the sampler's floor, or min-p's), and with top-p only the row's
nucleus: one program per row reads the row three times (its best, its mass, the draw),
where torch's ops read and write the whole ``[rows, vocab]`` matrix about ten times, from
a float32 copy (docs/design-decisions.md, "The unseeded draw in one kernel on a GPU").

Top-p alone asks for the smallest set of a row's best tokens holding ``top_p`` of its
mass. Sorting the vocabulary finds it without the host but sorts every row; taking the
best few candidates costs little but must ask whether they hold the nucleus, and that
answer reaches the host only by waiting for the step ("Top-p without waiting for the
device"). The kernels instead search, per row, the smallest logit of the nucleus: the
largest ``t`` whose tokens at or above it hold ``top_p`` of the row's mass (so tokens tied
with the nucleus's last one are kept, whatever their ids). Each pass weighs the row's mass
at or above ``NUCLEUS_WAYS`` cut points spread over the bracket still holding the answer;
the cut points are 32-bit order-preserving keys of the float32 logits, so
``NUCLEUS_PASSES`` passes of 16 ways end on the exact logit, whatever the logits' range.
``nucleus_thresholds`` returns that logit, for rows drawn by the seeded race.

Import-safe without triton (``HAS_TRITON`` is then False and ``serves`` says no).
"""

from __future__ import annotations

from typing import Any

import torch

from worker_svc.engine.triton_attention import HAS_TRITON, interpreting, tl, triton

__all__ = ["NUCLEUS_PASSES", "NUCLEUS_WAYS", "draw", "fail", "nucleus_thresholds", "serves"]

NUCLEUS_WAYS = 16  # cut points weighed per pass: 4 of the key's 32 bits
NUCLEUS_PASSES = 8  # 16**8 = 2**32: the bracket shrinks to the one exact key
_BLOCK = 512  # logits per tile: [_BLOCK, NUCLEUS_WAYS] comparisons per tile
_WARPS = 4


# Why the kernels failed to build here (set by ``fail``): the sampler then keeps torch's ops.
failed: str | None = None


def serves(logits: torch.Tensor) -> bool:
    """Whether the kernels can take these logits (float32, bfloat16 or float16 on a GPU,
    or on CPU under Triton's interpreter) and built here."""
    dev = logits.device.type
    on_device = dev == "cuda" or (dev == "cpu" and interpreting())
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return HAS_TRITON and failed is None and on_device and logits.dtype in floats


def fail(reason: str) -> None:
    """The kernels do not serve in this process from now on (a build failed at warm-up):
    slower sampling by torch's ops, never a worker that does not start."""
    global failed
    failed = reason


if HAS_TRITON:

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _order_key(bits):  # type: ignore[no-untyped-def]
        """float32 bits (as int32) <-> an int32 ordered as the floats are: a negative
        float's magnitude bits flipped. Its own inverse (the sign bit is kept)."""
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _tile(base, start, offs, vocab, scale):  # type: ignore[no-untyped-def]
        """One tile of a row's logits in float32, times the row's scale (1 / temperature)."""
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=-float("inf"))
        return x.to(tl.float32) * scale

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _row_max(base, offs, vocab, scale, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        m = tl.full((), -float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            m = tl.maximum(m, tl.max(_tile(base, start, offs, vocab, scale), axis=0))
        return m

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _nucleus(  # type: ignore[no-untyped-def]
        base, offs, vocab, scale, m, lowest, top_p,
        BLOCK: tl.constexpr, WAYS: tl.constexpr, PASSES: tl.constexpr,
    ):  # fmt: skip
        """The smallest (scaled) logit of the row's top-p nucleus, and the mass at or above
        it (in units of the best token's); the row's best is ``m``, tokens under ``lowest``
        weigh 0. Each pass weighs the mass at or above WAYS cut points over the key bracket
        still holding the answer; the first pass's first cut holds all of it, the softmax
        denominator. Invariant: mass(keys >= lo) >= target > mass(keys >= hi)."""
        m_sub = tl.where(m == -float("inf"), 0.0, m)  # an all -inf row: no NaN
        lo = _order_key(lowest.to(tl.int32, bitcast=True)).to(tl.int64)
        hi = _order_key(m.to(tl.int32, bitcast=True)).to(tl.int64) + 1
        ways = tl.arange(0, WAYS).to(tl.int64)
        target = tl.full((), 0.0, tl.float32)
        kept = tl.full((), 0.0, tl.float32)
        for step in range(PASSES):
            width = hi - lo
            cuts = (lo + width * ways // WAYS).to(tl.int32)  # cuts[0] == lo
            mass = tl.zeros((WAYS,), tl.float32)
            for start in range(0, vocab, BLOCK):
                x = _tile(base, start, offs, vocab, scale)
                weight = tl.where(x >= lowest, tl.exp(x - m_sub), 0.0)
                above = _order_key(x.to(tl.int32, bitcast=True))[:, None] >= cuts[None, :]
                mass += tl.sum(tl.where(above, weight[:, None], 0.0), axis=0)
            total = tl.sum(tl.where(ways == 0, mass, 0.0), axis=0)
            target = tl.where(step == 0, top_p * total, target)
            best = tl.max(tl.where(mass >= target, ways, 0), axis=0)  # last cut still holding it
            kept = tl.sum(tl.where(ways == best, mass, 0.0), axis=0)
            lo, hi = lo + width * best // WAYS, lo + width * (best + 1) // WAYS
        return _order_key(lo.to(tl.int32)).to(tl.float32, bitcast=True), kept

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _nucleus_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, top_p_ptr, out_ptr, vocab, row_stride,
        BLOCK: tl.constexpr, WAYS: tl.constexpr, PASSES: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        offs = tl.arange(0, BLOCK)
        top_p = tl.load(top_p_ptr + row)
        m = _row_max(base, offs, vocab, 1.0, BLOCK)
        lowest = tl.full((), -float("inf"), tl.float32)
        thr, _ = _nucleus(base, offs, vocab, 1.0, m, lowest, top_p, BLOCK, WAYS, PASSES)
        # top_p >= 1 keeps the whole row (rounding could trim its tail).
        tl.store(out_ptr + row, tl.where(top_p >= 1.0, -float("inf"), thr))

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _draw_kernel(  # type: ignore[no-untyped-def]
        logits_ptr, scale_ptr, floor_ptr, top_p_ptr, u_ptr, out_ptr, vocab, row_stride,
        BLOCK: tl.constexpr, WAYS: tl.constexpr, PASSES: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        offs = tl.arange(0, BLOCK)
        scale = tl.load(scale_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        m = _row_max(base, offs, vocab, scale, BLOCK)
        m_sub = tl.where(m == -float("inf"), 0.0, m)
        lowest = m - tl.load(floor_ptr + row)  # further below the best weighs 0 (min-p's floor)
        if top_p < 1.0:
            thr, kept = _nucleus(base, offs, vocab, scale, m, lowest, top_p, BLOCK, WAYS, PASSES)
        else:
            thr, kept = lowest, tl.full((), 0.0, tl.float32)
            for start in range(0, vocab, BLOCK):
                x = _tile(base, start, offs, vocab, scale)
                kept += tl.sum(tl.where(x >= lowest, tl.exp(x - m_sub), 0.0), axis=0)
        # Inverse CDF: the first token whose running mass passes u of the kept mass.
        target = tl.load(u_ptr + row) * kept
        cum = tl.full((), 0.0, tl.float32)
        token = tl.full((), 2**31 - 1, tl.int32)
        last = tl.full((), -1, tl.int32)
        for start in range(0, vocab, BLOCK):
            x = _tile(base, start, offs, vocab, scale)
            weight = tl.where(x >= thr, tl.exp(x - m_sub), 0.0)
            running = cum + tl.cumsum(weight, axis=0)
            at = start + offs
            token = tl.minimum(
                token, tl.min(tl.where((running > target) & (weight > 0), at, 2**31 - 1), axis=0)
            )
            last = tl.maximum(last, tl.max(tl.where(weight > 0, at, -1), axis=0))
            cum += tl.sum(weight, axis=0)
        # Rounding can leave the target at the summed mass: the last kept token then.
        tl.store(out_ptr + row, tl.where(token == 2**31 - 1, last, token).to(tl.int64))


def draw(
    logits: torch.Tensor, scales: torch.Tensor, floors: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """One token per row of ``logits [rows, vocab]``, drawn from softmax(logits * scales)
    by inverse CDF (a uniform from torch's generator per row), keeping only the tokens
    within ``floors`` of the row's best (the sampler's floor, or min-p's) and, where
    ``top_p < 1``, in its nucleus (``scales``, ``floors``, ``top_p``: float32 ``[rows]`` on
    the logits' device). One kernel where torch takes about ten passes over ``[rows,
    vocab]``, and no float32 copy of the logits; nothing is read back to the host."""
    rows, vocab = _checked(logits)
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows:
        u = torch.rand(rows, device=logits.device)
        launch: Any = _draw_kernel[(rows,)]
        launch(
            logits, scales, floors, top_p, u, out, vocab, logits.stride(0),
            BLOCK=_BLOCK, WAYS=NUCLEUS_WAYS, PASSES=NUCLEUS_PASSES, num_warps=_WARPS,
        )  # fmt: skip
    return out


def _checked(logits: torch.Tensor) -> tuple[int, int]:
    if not serves(logits) or logits.ndim != 2 or logits.stride(1) != 1:
        raise ValueError(
            "the kernels take [rows, vocab] float logits, unit stride, on a GPU (or interpreted)"
        )
    return logits.shape[0], logits.shape[1]


def nucleus_thresholds(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits [rows, vocab]`` (float32), the smallest logit of its top-p
    nucleus (``top_p [rows]``, float32, on the same device): the tokens with logits at or
    above it are the nucleus, ties with its last token included; -inf for ``top_p >= 1``.
    Nothing is read back to the host."""
    rows, vocab = _checked(logits)
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        launch: Any = _nucleus_kernel[(rows,)]
        launch(
            logits, top_p, out, vocab, logits.stride(0),
            BLOCK=_BLOCK, WAYS=NUCLEUS_WAYS, PASSES=NUCLEUS_PASSES, num_warps=_WARPS,
        )  # fmt: skip
    return out
