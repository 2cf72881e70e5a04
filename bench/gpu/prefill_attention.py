"""An experiment for the GPU kit: a step's prompt chunks (and decode rows) attended by one
Triton kernel launch over the paged KV cache, against the engine's path (one SDPA call
per prompt chunk, its context gathered when it continues one).

The engine attends each prompt chunk on its own (worker_svc.engine.attention): per layer
and chunk a few kernels and their Python, and a chunk that continues cached context first
gathers that context out of the blocks. This kernel serves every row of the step in one
launch: one program per (tile of ``block_q`` queries of one sequence, KV head), the GQA
group's heads stacked with the tile's queries as the rows of tensor-core products, walking
the sequence's block table a tile of keys at a time up to the tile's last query (causal),
with an online softmax in float32 -- the decode kernel's walk and its ``key_tile``
(``worker_svc.engine.triton_attention``) with a tile of queries instead of one. A decode
row is a sequence of one query. Plain causal attention only (no window, softcap or sinks).

One launch with fixed-size inputs is also what a CUDA graph of a mixed step needs. The kit
times both paths at the kit's shapes; the figures decide whether the engine takes it. Not
used by the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    from worker_svc.engine.triton_attention import _MIN_DOT, _next_pow2, key_tile, tile_blocks

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

__all__ = [
    "BLOCK_Q",
    "BLOCK_Q_WARPS",
    "HAS_TRITON",
    "PrefillBatch",
    "paged_prefill_attention",
    "prefill_batch",
]

BLOCK_Q = 16  # queries per program by default (times the GQA group: the rows of its products)
# Queries per program the kit tries, and the warps of each (more rows, more warps).
BLOCK_Q_WARPS = {16: 4, 32: 8}

if HAS_TRITON:
    # fmt: off
    @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
    def _prefill_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, q_starts_ptr, q_lens_ptr, ctx_lens_ptr,
        tile_seq_ptr, tile_m_ptr, out_ptr, scale, q_stride_t, q_stride_h, bt_stride, o_stride_t, o_stride_h,
        GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PAGES: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        # fmt: on
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
        # Query positions; padding rows sit at 0, so every row sees key 0 (no all-masked row).
        pos = tl.where(row_ok, ctx - q_len + qi, 0)
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
        hi = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_Q)  # past the tile's last query's key
        num_blocks = (hi + BLOCK_SIZE - 1) // BLOCK_SIZE
        for blk0 in range(0, num_blocks, PAGES):
            blk = blk0 + page
            phys = tl.load(block_tables_ptr + seq * bt_stride + blk, mask=blk < num_blocks, other=0).to(tl.int64)
            kpos = blk * BLOCK_SIZE + tok
            k_ok = kpos < hi
            offs = ((phys * BLOCK_SIZE + tok)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
            allowed = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
            # The first tile holds key 0, which every row sees: the running max is finite.
            m_i, l_i, acc = key_tile(
                q, k_cache_ptr, v_cache_ptr, offs, k_ok[:, None] & d_mask[None, :], allowed, m_i, l_i, acc,
                scale, 1.0, False, IEEE,
            )  # fmt: skip
        o_offs = tok_row[:, None] * o_stride_t + heads[:, None] * o_stride_h + d[None, :]
        tl.store(out_ptr + o_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


class PrefillBatch:
    """A step's sequences for :func:`paged_prefill_attention`: per sequence its first row
    in the packed queries, its query count and its context length after the step; and the
    tiles of ``BLOCK_Q`` queries (sequence, first query) that the programs take. Built once
    per step (every layer reuses it)."""

    def __init__(self, fields: dict[str, torch.Tensor], block_tables: torch.Tensor, block_q: int) -> None:
        self.q_starts, self.q_lens, self.ctx_lens = fields["q_starts"], fields["q_lens"], fields["ctx_lens"]
        self.tile_seq, self.tile_m = fields["tile_seq"], fields["tile_m"]
        self.block_tables = block_tables
        self.block_q = block_q


def prefill_batch(
    chunks: Sequence[tuple[int, int]],
    block_tables: torch.Tensor,
    device: torch.device,
    block_q: int = BLOCK_Q,
) -> PrefillBatch:
    """``chunks``: per sequence, in packed order, ``(cached tokens before the step, new
    tokens)``; ``block_tables [S, max_blocks]`` int32 on ``device``; ``block_q`` queries
    per program (a key of :data:`BLOCK_Q_WARPS`)."""
    if block_q not in BLOCK_Q_WARPS:
        raise ValueError(f"block_q must be one of {sorted(BLOCK_Q_WARPS)}, got {block_q}")
    starts, tiles_seq, tiles_m, row = [], [], [], 0
    for seq, (_, q_len) in enumerate(chunks):
        starts.append(row)
        row += q_len
        for m0 in range(0, q_len, block_q):
            tiles_seq.append(seq)
            tiles_m.append(m0)
    fields = {
        "q_starts": starts,
        "q_lens": [n for _, n in chunks],
        "ctx_lens": [c + n for c, n in chunks],
        "tile_seq": tiles_seq,
        "tile_m": tiles_m,
    }
    tensors = {k: torch.tensor(v, dtype=torch.int32, device=device) for k, v in fields.items()}
    return PrefillBatch(tensors, block_tables, block_q)


def paged_prefill_attention(
    q: torch.Tensor, cache: torch.Tensor, batch: PrefillBatch, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of every row of ``q [T, H, D]`` (packed as ``batch`` says) over its
    sequence's paged context in ``cache [2, blocks, block_size, Hkv, D]`` (the step's own
    K/V already stored there) -> ``out [T, H, D]``."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    _, heads, head_dim = q.shape
    _, _, block_size, hkv, _ = cache.shape
    if out is None:
        out = torch.empty_like(q)
    group = heads // hkv
    launch: Any = _prefill_kernel[(batch.tile_seq.shape[0], hkv)]
    launch(
        q, cache[0], cache[1], batch.block_tables, batch.q_starts, batch.q_lens, batch.ctx_lens,
        batch.tile_seq, batch.tile_m, out, scale, q.stride(0), q.stride(1), batch.block_tables.stride(0),
        out.stride(0), out.stride(1), GROUP=group, NUM_KV_HEADS=hkv, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_Q=batch.block_q, BLOCK_G=_next_pow2(group),
        BLOCK_D=max(_MIN_DOT, _next_pow2(head_dim)), PAGES=tile_blocks(block_size),
        IEEE=cache.dtype == torch.float32, num_warps=BLOCK_Q_WARPS[batch.block_q],
    )  # fmt: skip
    return out
