"""Triton kernels for the GPU path: KV store and paged decode attention.

Import-safe without triton (``HAS_TRITON`` is then False and the wrappers raise).
Layouts match :mod:`worker_svc.engine.attention`: cache ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (contiguous), slot = ``block * block_size + offset``.

``paged_decode_attention`` runs one program per (sequence, KV head, split), covering the
``H // Hkv`` query heads of that GQA group. It walks its share of the sequence's block
table a tile of keys (``KEYS_PER_TILE``, whole KV blocks) at a time, scores and weighted
values as tensor-core matrix products, with an online (streaming) softmax in fp32, so no
padded context is materialized; with more than one split a second kernel merges the
splits' partial softmaxes (flash-decoding).

``paged_prefill_attention`` attends every prompt chunk of a step in one launch (fresh
prompts and chunks continuing cached context alike): one program per (tile of ``block_q``
queries of one sequence, KV head), the GQA group's heads stacked with the tile's queries
as the rows of tensor-core products, walking the sequence's block table a tile of keys at a
time up to the tile's last query (causal), with the decode kernel's online softmax
(``key_tile``). Per layer that is one kernel where one SDPA call per chunk, with its
context gathered out of the blocks, cost a few kernels and their Python each
(docs/design-decisions.md, "Prefill attention in one launch").

Both kernels also serve per-layer attention: a sliding window (the walk starts at the
window's first block), logit softcapping and attention sinks (one extra logit per head in
the denominator), checked against the torch path under TRITON_INTERPRET=1 by
``test_arch_matrix`` and ``test_triton_layers``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "HAS_TRITON",
    "PREFILL_WARPS",
    "PrefillBatch",
    "backend_supported",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_block_q",
    "prefill_fields",
    "split_count",
    "store_kv",
    "tile_blocks",
]

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    triton = None
    tl = None
    HAS_TRITON = False


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: kernels run on CPU tensors through Triton's
    interpreter (how the tests check them on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def backend_supported(device: torch.device, block_size: int) -> bool:
    """Whether the triton path can serve this device / block size (power-of-two blocks)."""
    on_device = device.type == "cuda" or (device.type == "cpu" and interpreting())
    return HAS_TRITON and on_device and block_size & (block_size - 1) == 0


_NO_WINDOW = 2**30  # "no sliding window": longer than any context


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


if HAS_TRITON:

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _store_kv_kernel(  # type: ignore[no-untyped-def]
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        row_stride,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        tok = tl.program_id(0)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = (offs < ROW) & (slot >= 0)  # negative slots are padding
        k = tl.load(key_ptr + tok * row_stride + offs, mask=mask)
        v = tl.load(value_ptr + tok * row_stride + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def key_tile(  # type: ignore[no-untyped-def]
        q, k_cache_ptr, v_cache_ptr, offs, kv_mask, allowed, m_i, l_i, acc, scale, softcap,
        HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """One tile of keys into a running (online) softmax of the query rows ``q [M, D]``:
        the tile's K/V at element offsets ``offs [N, D]`` of the caches (where ``kv_mask``),
        ``allowed [M, N]`` says which query sees which key. Returns the new running max, sum
        and unnormalized output ``(m_i [M], l_i [M], acc [M, D])``."""
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if IEEE:  # float32 caches: no TF32 rounding of the products
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, N]
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 * sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(allowed, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen no key yet (a window starting past this tile) keeps max -inf:
        # it subtracts 0 instead, so its weights are exp(-inf) = 0, not NaN.
        m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_sub)
        p = tl.exp(scores - m_sub[:, None])
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:  # probabilities in the cache's precision, as flash attention's kernels
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _paged_decode_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        rows_ptr,
        out_ptr,
        part_ptr,
        stats_ptr,
        scale,
        q_stride_b,
        q_stride_h,
        bt_stride,
        o_stride_b,
        o_stride_h,
        sinks_ptr,
        window,
        softcap,
        blocks_per_split,
        HAS_SINKS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        SPLIT: tl.constexpr,
        GROUP: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PAGES: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        # One program per (sequence, kv head, split of its blocks): the GROUP query heads
        # sharing that kv head are processed together so each K/V block is loaded once, as
        # the rows of a matrix product (tensor cores; BLOCK_G pads the group to a tile).
        # Each iteration covers PAGES KV blocks (a tile of keys), docs/design-decisions.md,
        # "Decode attention: tiles of keys on tensor cores".
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        row = tl.load(rows_ptr + seq).to(tl.int64)  # q's and out's row of this sequence
        seq_len = tl.load(seq_lens_ptr + seq)
        g = tl.arange(0, BLOCK_G)
        g_mask = g < GROUP
        heads = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q_offs = row * q_stride_b + heads[:, None] * q_stride_h + d[None, :]
        q_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)  # [G, D]
        n = tl.arange(0, PAGES * BLOCK_SIZE)  # the tile's keys: PAGES blocks of BLOCK_SIZE
        page, tok = n // BLOCK_SIZE, n % BLOCK_SIZE
        m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        # A sliding window starts at its first key: earlier blocks are skipped. No window
        # comes as window >= any length (no data-dependent branch in the kernel).
        first = tl.maximum(seq_len - window, 0)
        lo = tl.maximum(first // BLOCK_SIZE, split * blocks_per_split)
        hi = tl.minimum(num_blocks, (split + 1) * blocks_per_split)
        for blk0 in range(lo, hi, PAGES):
            blk = blk0 + page
            phys = tl.load(block_tables_ptr + seq * bt_stride + blk, mask=blk < hi, other=0).to(tl.int64)
            pos = blk * BLOCK_SIZE + tok
            # Every tile has a valid key (its first block is in [lo, hi)): m_new is finite.
            t_mask = (blk < hi) & (pos < seq_len) & (pos >= first)
            # [PAGES * BLOCK_SIZE, BLOCK_D] offsets of the tile's K/V rows for kv_head.
            offs = ((phys * BLOCK_SIZE + tok)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
            kv_mask = t_mask[:, None] & d_mask[None, :]
            m_i, l_i, acc = key_tile(
                q, k_cache_ptr, v_cache_ptr, offs, kv_mask, t_mask[None, :], m_i, l_i, acc, scale, softcap,
                HAS_SOFTCAP, IEEE,
            )  # fmt: skip
        if SPLIT:  # this split's running max, sum and unnormalized output: _merge_kernel ends it
            nsplit = tl.num_programs(2)
            at = (seq * NUM_KV_HEADS * GROUP + heads) * nsplit + split  # [G] of [B, H, S]
            tl.store(stats_ptr + at * 2, m_i, mask=g_mask)
            tl.store(stats_ptr + at * 2 + 1, l_i, mask=g_mask)
            tl.store(part_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
        else:
            if HAS_SINKS:  # one extra logit per head, in the denominator only
                sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
                m_fin = tl.maximum(m_i, sink)
                alpha = tl.exp(m_i - m_fin)
                l_i = l_i * alpha + tl.exp(sink - m_fin)
                acc = acc * alpha[:, None]
            out = acc / l_i[:, None]
            o_offs = row * o_stride_b + heads[:, None] * o_stride_h + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _merge_kernel(  # type: ignore[no-untyped-def]
        part_ptr,
        stats_ptr,
        rows_ptr,
        out_ptr,
        o_stride_b,
        o_stride_h,
        sinks_ptr,
        num_splits,
        HAS_SINKS: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per (sequence, query head): its splits' partial softmaxes merged.
        # A split past the sequence's end (or before its window) left max -inf and sum 0:
        # its weight is 0.
        seq = tl.program_id(0)
        head = tl.program_id(1)
        row = tl.load(rows_ptr + seq).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        s_mask = s < num_splits
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        at = (seq * NUM_HEADS + head) * num_splits + s
        m_s = tl.load(stats_ptr + at * 2, mask=s_mask, other=-float("inf"))
        l_s = tl.load(stats_ptr + at * 2 + 1, mask=s_mask, other=0.0)
        m = tl.max(m_s, axis=0)  # finite: a sequence has >= 1 key, in some split
        if HAS_SINKS:  # one extra logit per head, in the denominator only
            sink = tl.load(sinks_ptr + head).to(tl.float32)
            m = tl.maximum(m, sink)
        w = tl.exp(m_s - m)
        part = tl.load(
            part_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
        )
        acc = tl.sum(w[:, None] * part, axis=0)
        denom = tl.sum(w * l_s, axis=0)
        if HAS_SINKS:
            denom += tl.exp(sink - m)
        tl.store(
            out_ptr + row * o_stride_b + head * o_stride_h + d,
            (acc / denom).to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )

    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _prefill_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, q_starts_ptr, q_lens_ptr, ctx_lens_ptr,
        tile_seq_ptr, tile_m_ptr, out_ptr, scale, q_stride_t, q_stride_h, bt_stride, o_stride_t, o_stride_h,
        sinks_ptr, window, softcap,
        HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PAGES: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        # One program per (tile of BLOCK_Q queries of one sequence, kv head): the tile's
        # queries times the GROUP heads sharing the kv head are the rows of the products.
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        m0 = tl.load(tile_m_ptr + tile)  # the tile's first query, within the sequence's chunk
        q_start = tl.load(q_starts_ptr + seq)
        q_len = tl.load(q_lens_ptr + seq)
        ctx = tl.load(ctx_lens_ptr + seq)  # context after this step (cached + the chunk)
        r = tl.arange(0, BLOCK_Q * BLOCK_G)
        qi = m0 + r // BLOCK_G
        g = r % BLOCK_G
        row_ok = (qi < q_len) & (g < GROUP)
        # Query positions; padding rows sit at the tile's first, whose keys are all walked.
        p0 = ctx - q_len + m0
        pos = tl.where(row_ok, ctx - q_len + qi, p0)
        heads = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        tok_row = (q_start + qi).to(tl.int64)
        q_offs = tok_row[:, None] * q_stride_t + heads[:, None] * q_stride_h + d[None, :]
        q_mask = row_ok[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)
        n = tl.arange(0, PAGES * BLOCK_SIZE)
        page, tok = n // BLOCK_SIZE, n % BLOCK_SIZE
        m_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], dtype=tl.float32)
        hi = tl.minimum(ctx, p0 + BLOCK_Q)  # past the tile's last query's key
        num_blocks = (hi + BLOCK_SIZE - 1) // BLOCK_SIZE
        # A query at p sees keys p - window < k <= p: the walk starts at the block of the
        # tile's first query's first key (no window comes as window >= any length).
        lo = tl.maximum(p0 - window + 1, 0) // BLOCK_SIZE
        for blk0 in range(lo, num_blocks, PAGES):
            blk = blk0 + page
            phys = tl.load(block_tables_ptr + seq * bt_stride + blk, mask=blk < num_blocks, other=0).to(
                tl.int64
            )
            kpos = blk * BLOCK_SIZE + tok
            k_ok = kpos < hi
            offs = ((phys * BLOCK_SIZE + tok)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
            allowed = (
                k_ok[None, :] & (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - window)
            )
            m_i, l_i, acc = key_tile(
                q, k_cache_ptr, v_cache_ptr, offs, k_ok[:, None] & d_mask[None, :], allowed, m_i, l_i, acc,
                scale, softcap, HAS_SOFTCAP, IEEE,
            )  # fmt: skip
        if HAS_SINKS:  # one extra logit per head, in the denominator only
            sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0).to(tl.float32)
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_fin)
            l_i = l_i * alpha + tl.exp(sink - m_fin)
            acc = acc * alpha[:, None]
        o_offs = tok_row[:, None] * o_stride_t + heads[:, None] * o_stride_h + d[None, :]
        tl.store(out_ptr + o_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use attention_backend='torch'")


def _checked(q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``q`` with unit stride over head_dim (the kernels step over tokens and heads by
    stride, not over dims); ValueError for a non-contiguous cache."""
    if not cache.is_contiguous():
        raise ValueError("KV cache must be contiguous")
    return q if q.stride(2) == 1 else q.contiguous()


def _layer_args(
    q: torch.Tensor, window: int, softcap: float, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, int, float]:
    """A layer's window, softcap and sinks as the kernels take them: sinks in float32 (a
    placeholder when none), no window as one longer than any context, no softcap as 1.0
    (unused: ``HAS_SOFTCAP`` is off)."""
    sink_f32 = q.new_zeros(1, dtype=torch.float32) if sinks is None else sinks.detach().float().contiguous()
    return sink_f32, int(window) if window > 0 else _NO_WINDOW, float(softcap) if softcap else 1.0


def store_kv(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton twin of :func:`attention.store_kv` (``key/value [T, Hkv, D]``)."""
    _require_triton()
    num_tokens, hkv, d = key.shape
    if num_tokens == 0:
        return
    row = hkv * d
    k2 = key.reshape(num_tokens, row).to(cache.dtype).contiguous()
    v2 = value.reshape(num_tokens, row).to(cache.dtype).contiguous()
    launch: Any = _store_kv_kernel[(num_tokens,)]
    launch(k2, v2, cache[0], cache[1], slot_mapping, k2.stride(0), ROW=row, BLOCK=_next_pow2(row))


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    *,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of each sequence's query row over its paged context -> ``out``.

    ``block_tables [B, max_blocks]`` int32 and ``seq_lens [B]`` int32 (context length
    including the token being decoded, whose KV must already be stored). ``window``
    (keys ``p - window < k <= p``), ``softcap`` and ``sinks [H]`` as in
    :mod:`worker_svc.engine.attention`; 0 / 0.0 / None mean none. Sequence ``b`` reads
    row ``rows[b]`` of ``q [T, H, D]`` and writes the same row of ``out [T, H, D]`` (by
    default rows 0..B-1, and a new tensor like ``q``); other rows of ``out`` are left as
    they are. ``num_splits`` (default: enough to fill the GPU, :func:`split_count`)
    divides each sequence's blocks among that many programs, merged by a second kernel.
    """
    _require_triton()
    _, heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    _, _, block_size, hkv, _ = cache.shape
    q = _checked(q, cache)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    sink_f32, window_arg, softcap_arg = _layer_args(q, window, softcap, sinks)
    if batch == 0:
        return out
    if rows is None:
        rows = torch.arange(batch, device=q.device)
    max_blocks = block_tables.shape[1]
    pages = tile_blocks(block_size)
    splits = num_splits or split_count(batch * hkv, max_blocks, block_size, q.device)
    per_split = -(-max_blocks // (splits * pages)) * pages  # whole tiles per split
    part = stats = out  # unused without splits (any tensor will do)
    if splits > 1:
        part = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        stats = torch.empty((batch, heads, splits, 2), dtype=torch.float32, device=q.device)
    launch: Any = _paged_decode_kernel[(batch, hkv, splits)]
    launch(
        q, cache[0], cache[1], block_tables, seq_lens, rows, out, part, stats, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        sink_f32, window_arg, softcap_arg, per_split,
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=bool(softcap), SPLIT=splits > 1, GROUP=heads // hkv,
        NUM_KV_HEADS=hkv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(_next_pow2(heads // hkv), _MIN_DOT), BLOCK_D=max(_next_pow2(head_dim), _MIN_DOT),
        PAGES=pages, IEEE=cache.dtype == torch.float32,
    )  # fmt: skip
    if splits > 1:
        merge: Any = _merge_kernel[(batch, heads)]
        merge(
            part, stats, rows, out, out.stride(0), out.stride(1), sink_f32, splits,
            HAS_SINKS=sinks is not None, NUM_HEADS=heads, HEAD_DIM=head_dim,
            BLOCK_S=max(_next_pow2(splits), 2), BLOCK_D=_next_pow2(head_dim),
        )  # fmt: skip
    return out


# The kernel's tile of keys: KEYS_PER_TILE (a whole number of KV blocks, at least one), and
# _MIN_DOT, the smallest side of a tensor-core matrix product (query heads of a GQA group
# and head_dim are padded to it).
KEYS_PER_TILE = 64
_MIN_DOT = 16


def tile_blocks(block_size: int) -> int:
    """KV blocks per tile of keys (one iteration of the decode kernel's walk)."""
    return max(1, KEYS_PER_TILE // block_size)


# Split-KV (flash-decoding): a decode step of few sequences has too few (sequence, KV head)
# programs to occupy the GPU, and each walks its whole context alone; splitting the walk
# gives every multiprocessor work (docs/design-decisions.md, "Decode attention splits long
# contexts"). A split covers at least one tile, so short contexts stay whole.
_MAX_SPLITS = 64
_INTERPRETER_SMS = 8  # under TRITON_INTERPRET, as a small GPU: the CPU tests then run split steps too


def split_count(programs: int, max_blocks: int, block_size: int, device: torch.device) -> int:
    """Splits per sequence for ``programs`` (sequence, KV head) programs over block tables
    ``max_blocks`` blocks of ``block_size`` wide: enough for two programs per
    multiprocessor, 1 when already so, and at most one per tile of keys."""
    target = 2 * _multiprocessors(device)
    if programs >= target:
        return 1
    tiles = -(-max_blocks // tile_blocks(block_size))
    return max(1, min(-(-target // programs), tiles, _MAX_SPLITS))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


# ------------------------------------------------------------------ prefill in one launch
# Queries per program, and the warps of each (more rows, more warps). 32 was the faster on
# an H200 with GQA groups of 4 (bench/results/gpu.json, prefill_attention); a program's
# rows are its queries times the group padded to a power of two, kept to at most 128.
PREFILL_WARPS = {16: 4, 32: 8}
_PREFILL_ROWS = 128


def prefill_block_q(group: int) -> int:
    """Queries per program of :func:`paged_prefill_attention` for GQA groups of ``group``
    query heads per KV head."""
    return 32 if 32 * _next_pow2(group) <= _PREFILL_ROWS else 16


# The fields of a PrefillBatch, in the order prefill_fields lists them.
PREFILL_FIELDS = ("q_starts", "q_lens", "ctx_lens", "tile_seq", "tile_m", "block_tables")


def prefill_fields(
    chunks: Sequence[tuple[int, int, int, Sequence[int]]], block_size: int, block_q: int
) -> tuple[dict[str, list[int]], int]:
    """Host lists of a step's prompt chunks for :class:`PrefillBatch`, and the width of its
    block tables. ``chunks``: per sequence ``(first packed row, cached tokens before the
    step, new tokens, block table)``; ``block_q`` a key of :data:`PREFILL_WARPS`."""
    if block_q not in PREFILL_WARPS:
        raise ValueError(f"block_q must be one of {sorted(PREFILL_WARPS)}, got {block_q}")
    width = max(-(-(c + n) // block_size) for _, c, n, _ in chunks)
    fields: dict[str, list[int]] = {name: [] for name in PREFILL_FIELDS}
    tables = fields["block_tables"]
    for seq, (row, cached, new, table) in enumerate(chunks):
        fields["q_starts"].append(row)
        fields["q_lens"].append(new)
        fields["ctx_lens"].append(cached + new)
        starts = range(0, new, block_q)
        fields["tile_seq"] += [seq] * len(starts)
        fields["tile_m"] += starts
        row_blocks = table[: -(-(cached + new) // block_size)]
        tables += row_blocks
        tables += [0] * (width - len(row_blocks))
    return fields, width


@dataclass
class PrefillBatch:
    """A step's prompt chunks for :func:`paged_prefill_attention`, int32 on the device
    (built once per step, every layer reuses it): per sequence its first packed row, query
    count and context length after the step, its block table ``[S, width]``; and the tiles
    of ``block_q`` queries (sequence, first query) that the programs take."""

    q_starts: torch.Tensor
    q_lens: torch.Tensor
    ctx_lens: torch.Tensor
    tile_seq: torch.Tensor
    tile_m: torch.Tensor
    block_tables: torch.Tensor
    block_q: int


def paged_prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    batch: PrefillBatch,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the prompt chunks' rows of ``q [T, H, D]`` over each sequence's
    paged context in ``cache [2, blocks, block_size, Hkv, D]`` (the step's own K/V already
    stored there) into the same rows of ``out [T, H, D]`` (a new tensor like ``q`` by
    default); other rows of ``out`` are left as they are. ``window``, ``softcap`` and
    ``sinks [H]`` as :func:`paged_decode_attention`'s (0 / 0.0 / None: none)."""
    _require_triton()
    _, heads, head_dim = q.shape
    _, _, block_size, hkv, _ = cache.shape
    q = _checked(q, cache)
    if out is None:
        out = torch.empty_like(q)
    elif out.stride(2) != 1:
        raise ValueError("out must have unit stride over head_dim")
    group = heads // hkv
    sink_f32, window_arg, softcap_arg = _layer_args(q, window, softcap, sinks)
    launch: Any = _prefill_kernel[(batch.tile_seq.shape[0], hkv)]
    launch(
        q, cache[0], cache[1], batch.block_tables, batch.q_starts, batch.q_lens, batch.ctx_lens,
        batch.tile_seq, batch.tile_m, out, scale, q.stride(0), q.stride(1), batch.block_tables.stride(0),
        out.stride(0), out.stride(1), sink_f32, window_arg, softcap_arg,
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=bool(softcap),
        GROUP=group, NUM_KV_HEADS=hkv, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_Q=batch.block_q, BLOCK_G=_next_pow2(group),
        BLOCK_D=max(_MIN_DOT, _next_pow2(head_dim)), PAGES=tile_blocks(block_size),
        IEEE=cache.dtype == torch.float32, num_warps=PREFILL_WARPS[batch.block_q],
    )  # fmt: skip
    return out
