"""The GPU kit's prefill-attention experiment (bench/gpu/prefill_attention.py): one launch
over a step's fresh prompts, continued chunks and decode rows equals causal attention over
each sequence's context. Checked on CPU through Triton's interpreter (float32 and float16;
run by tests/worker_engine/test_triton_interpret.py)."""

from __future__ import annotations

import os

import pytest
import torch

from bench.gpu import prefill_attention

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1 (test_triton_interpret.py runs it so)",
)

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4
# (tokens cached before the step, new tokens): a fresh prompt longer than a tile of queries,
# a chunk continuing cached context past a tile of keys, a decode row, a short prompt.
CHUNKS = [(0, 37), (70, 9), (19, 1), (0, 3)]


def _reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """float64 causal attention of each sequence's rows of ``q`` over its keys/values."""
    out, row = [], 0
    for (cached, new), k, v in zip(CHUNKS, keys, values, strict=True):
        qs = q[row : row + new].double().transpose(0, 1)  # [H, new, D]
        kk = k.double().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)  # [H, ctx, D]
        vv = v.double().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        scores = qs @ kk.transpose(1, 2) * DIM**-0.5
        allowed = torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out.append((probs @ vv).transpose(0, 1))
        row += new
    return torch.cat(out)


@pytest.mark.parametrize("block_q", sorted(prefill_attention.BLOCK_Q_WARPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_launch_equals_causal_attention_per_sequence(dtype: torch.dtype, block_q: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in CHUNKS) + 3
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    # Each sequence's blocks scattered over the cache, in reverse: the table is what is read.
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-(c + n) // BLOCK) for c, n in CHUNKS)
    tables, keys, values = torch.zeros(len(CHUNKS), width, dtype=torch.int32), [], []
    for i, (cached, new) in enumerate(CHUNKS):
        blocks = [order.pop() for _ in range(-(-(cached + new) // BLOCK))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        flat = cache[:, blocks].reshape(2, -1, KV_HEADS, DIM)[:, : cached + new]
        keys.append(flat[0])
        values.append(flat[1])
    q = torch.randn(sum(n for _, n in CHUNKS), HEADS, DIM, generator=gen).to(dtype)
    want = _reference(q, keys, values)
    batch = prefill_attention.prefill_batch(CHUNKS, tables.to(device), torch.device(device), block_q)
    got = prefill_attention.paged_prefill_attention(q.to(device), cache.to(device), batch, DIM**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


def test_the_kits_step_compares_the_engines_path_with_one_launch() -> None:
    """The kit's row (bench.gpu.steps) on a small profile: the engine's attention for a
    mixed step (decode rows, a fresh prompt, a continued chunk) equals the one launch's."""
    from dataclasses import replace

    from bench.gpu import steps
    from bench.gpu.context import PROFILES

    device = "cuda" if torch.cuda.is_available() else "cpu"
    profile = replace(PROFILES["cpu-dry-run"], device=device)
    calls = []

    def once(fn, n):  # type: ignore[no-untyped-def]
        calls.append(fn())
        return 1.0

    row = steps._prefill_attention_row(profile, [(20, 1), (0, 19), (33, 1), (40, 24)], timer=once)
    assert (
        row["sequences"] == 4
        and row["tokens"] == 45
        and len(calls) == 1 + len(row["one_launch_us_by_block_q"])
    )
    assert row["max_abs_diff"] < 1e-5  # float32: equal up to summation order
