"""The native CPU paged-decode kernel against a dense reference and the torch path."""

from __future__ import annotations

import pytest
import torch

from worker_svc.engine import cpu_attention
from worker_svc.engine.attention import attention_context, build_attention_metadata, paged_attention_forward

KERNEL = cpu_attention.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: native CPU attention unavailable")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _reference(
    q: torch.Tensor, cache: torch.Tensor, table: list[int], length: int, scale: float
) -> torch.Tensor:
    """Dense attention of one query ``[H, D]`` over the first ``length`` cached tokens."""
    hkv, d = cache.shape[3], cache.shape[4]
    blocks = torch.tensor(table, dtype=torch.long)
    k = cache[0][blocks].reshape(-1, hkv, d)[:length].float()
    v = cache[1][blocks].reshape(-1, hkv, d)[:length].float()
    group = q.shape[0] // hkv
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    probs = (torch.einsum("hd,lhd->hl", q.float(), k) * scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 32), (4, 4, 64), (6, 2, 48)])
def test_kernel_matches_dense_attention(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Lengths inside a block, on a boundary and spanning many blocks; scattered block ids;
    decode rows at arbitrary packed positions of a transposed (non-contiguous) q."""
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs = 40, 16
    cache = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
    lens = [1, 16, 17, 100, 37]
    tables = [torch.randperm(num_blocks, generator=gen)[:8].tolist() for _ in lens]
    tokens = 9
    q = torch.randn(1, heads, tokens, head_dim, generator=gen).to(dtype)[0].transpose(0, 1)
    rows = torch.tensor([8, 0, 3, 4, 6])
    out = torch.zeros(tokens, heads, head_dim, dtype=dtype)
    tables_t = torch.tensor(tables, dtype=torch.int32)
    KERNEL(q, cache, tables_t, torch.tensor(lens, dtype=torch.int32), rows, out, 0.2)
    for b, row in enumerate(rows.tolist()):
        expected = _reference(q[row], cache, tables[b], lens[b], 0.2)
        torch.testing.assert_close(out[row].float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    untouched = sorted(set(range(tokens)) - set(rows.tolist()))
    assert not out[untouched].any(), "the kernel wrote rows that are not decode rows"


class _Layer(torch.nn.Module):
    layer_idx = 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_equals_torch_backend_in_a_mixed_step(dtype: torch.dtype) -> None:
    """Decodes and a prefill chunk in one packed step: same output and same KV cache writes."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, bs = 4, 2, 32, 8
    chunks = [(20, 1, [3, 5, 7]), (4, 5, [1, 2]), (8, 1, [9, 4]), (0, 3, [6])]  # (start, q_len, table)
    tokens = sum(q_len for _, q_len, _ in chunks)
    query = torch.randn(1, heads, tokens, head_dim, generator=gen).to(dtype)
    key = torch.randn(1, kv_heads, tokens, head_dim, generator=gen).to(dtype)
    value = torch.randn(1, kv_heads, tokens, head_dim, generator=gen).to(dtype)
    base = torch.randn(2, 12, bs, kv_heads, head_dim, generator=gen).to(dtype)
    results = {}
    for backend in ("torch", "cpu"):
        caches = [base.clone()]
        meta = build_attention_metadata(chunks, bs, caches, torch.device("cpu"), backend)
        with attention_context(meta):
            out, _ = paged_attention_forward(_Layer(), query, key, value, None, 0.3)
        results[backend] = (out, caches[0])
    torch.testing.assert_close(results["cpu"][0], results["torch"][0], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(results["cpu"][1], results["torch"][1], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequences_spread_over_threads_equal_each_sequence_alone(dtype: torch.dtype) -> None:
    """A batch's sequences run on torch's OpenMP team, each with its own score buffer: the
    batch's output equals every sequence decoded alone (one thread), bit for bit."""
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, bs, num_blocks = 6, 2, 64, 16, 400
    cache = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.randint(100, 600, (24,), generator=gen, dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:40] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        batch = torch.zeros_like(q)
        KERNEL(q, cache, tables, lens, torch.arange(len(lens)), batch, 0.125)
    finally:
        torch.set_num_threads(threads)
    for b in range(len(lens)):
        alone = torch.zeros_like(q)
        KERNEL(q, cache, tables[b : b + 1], lens[b : b + 1], torch.tensor([b]), alone, 0.125)
        assert torch.equal(batch[b], alone[b]), f"sequence {b}"
