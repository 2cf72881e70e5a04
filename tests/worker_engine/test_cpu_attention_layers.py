"""Per-layer attention (sliding window, logit softcapping, attention sinks) in the native
CPU decode kernel and the torch decode path, against a dense reference."""

from __future__ import annotations

import pytest
import torch

from worker_svc.engine import cpu_attention
from worker_svc.engine.attention import (
    AttentionMetadata,
    LayerAttention,
    _decode_layer,
    build_attention_metadata,
)

KERNEL = cpu_attention.load()
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LAYERS = {
    "window": LayerAttention(window=20),
    "window<block": LayerAttention(window=5),
    "softcap": LayerAttention(softcap=0.5),
    "sinks": LayerAttention(sinks=torch.tensor([3.0, -1.0, 0.5, 8.0, 0.0, -4.0, 1.0, 2.0])),
    "all": LayerAttention(window=33, softcap=2.0, sinks=torch.linspace(-2, 2, 8)),
}


def _reference(
    q: torch.Tensor, cache: torch.Tensor, table: list[int], length: int, scale: float, layer: LayerAttention
) -> torch.Tensor:
    """Dense attention of one query ``[H, D]`` at position ``length - 1``, written from the definitions."""
    hkv, d = cache.shape[3], cache.shape[4]
    blocks = torch.tensor(table, dtype=torch.long)
    k = cache[0][blocks].reshape(-1, hkv, d)[:length].float()
    v = cache[1][blocks].reshape(-1, hkv, d)[:length].float()
    group = q.shape[0] // hkv
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", q.float(), k) * scale
    if layer.softcap is not None:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    if layer.window is not None:
        scores[:, : max(0, length - layer.window)] = float("-inf")
    if layer.sinks is not None:
        scores = torch.cat([scores, layer.sinks.float()[:, None]], dim=1)
    probs = scores.softmax(-1)[:, :length]
    return torch.einsum("hl,lhd->hd", probs, v)


def _case(
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[int], AttentionMetadata]:
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, heads, kv_heads, head_dim = 40, 16, 8, 2, 32
    cache = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
    lens = [1, 16, 17, 100, 37, 5]
    tables = [torch.randperm(num_blocks, generator=gen)[:8].tolist() for _ in lens]
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    chunks = [(n - 1, 1, t) for n, t in zip(lens, tables, strict=True)]
    meta = build_attention_metadata(chunks, bs, [cache], torch.device("cpu"), "cpu")
    return q, cache, tables, lens, meta


@pytest.mark.skipif(KERNEL is None, reason="no C compiler: native CPU attention unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(LAYERS))
def test_kernel_honours_window_softcap_and_sinks(dtype: torch.dtype, name: str) -> None:
    assert KERNEL is not None
    layer = LAYERS[name]
    q, cache, tables, lens, meta = _case(dtype)
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    out = torch.zeros_like(q)
    rows = torch.arange(len(lens))
    KERNEL(
        q,
        cache,
        meta.decode_block_tables,
        meta.decode_seq_lens,
        rows,
        out,
        0.2,
        layer.window or 0,
        layer.softcap or 0.0,
        layer.sinks,
    )
    for b in range(len(lens)):
        expected = _reference(q[b], cache, tables[b], lens[b], 0.2, layer)
        torch.testing.assert_close(out[b].float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("name", list(LAYERS))
def test_torch_decode_honours_window_softcap_and_sinks(name: str) -> None:
    layer = LAYERS[name]
    q, cache, tables, lens, meta = _case(torch.float32)
    out = _decode_layer(q, cache, meta, 0.2, layer)
    for b in range(len(lens)):
        expected = _reference(q[b], cache, tables[b], lens[b], 0.2, layer)
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)
