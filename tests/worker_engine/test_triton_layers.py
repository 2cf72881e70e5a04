"""The Triton paged-decode and one-launch prefill kernels with per-layer attention (sliding
window, logit softcapping, attention sinks) against the dense reference of
test_cpu_attention_layers.

Natively on a GPU; on CPU only under TRITON_INTERPRET=1 (test_arch_matrix runs this file
in a child pytest with it set)."""

from __future__ import annotations

import pytest
import torch

from tests.worker_engine.test_cpu_attention_layers import LAYERS, _case, _reference
from worker_svc.engine import triton_attention
from worker_svc.engine.attention import build_attention_metadata

pytestmark = pytest.mark.skipif(
    not triton_attention.HAS_TRITON or not (torch.cuda.is_available() or triton_attention.interpreting()),
    reason="needs triton with CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("name", list(LAYERS))
def test_triton_decode_honours_window_softcap_and_sinks(name: str, num_splits: int) -> None:
    layer = LAYERS[name]
    q, cache, tables, lens, meta = _case(torch.float32)
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sinks = None if layer.sinks is None else layer.sinks.to(device)
    out = triton_attention.paged_decode_attention(
        q.to(device),
        cache.to(device),
        meta.decode_block_tables.to(device),
        meta.decode_seq_lens.to(device),
        0.2,
        layer.window or 0,
        layer.softcap or 0.0,
        sinks,
        num_splits=num_splits,
    ).cpu()
    for b in range(len(lens)):
        expected = _reference(q[b], cache, tables[b], lens[b], 0.2, layer)
        torch.testing.assert_close(out[b], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("block_q", sorted(triton_attention.PREFILL_WARPS))
@pytest.mark.parametrize("name", list(LAYERS))
def test_triton_prefill_honours_window_softcap_and_sinks(name: str, block_q: int, block_size: int) -> None:
    """Prompt chunks in one launch (fresh, continuing cached context past a window, short),
    each query row against the dense reference at its position; a decode row among them is
    left as it was. With 64-token blocks a tile of keys is one block, so a window can leave
    a query with no key in the walk's first tile."""
    layer = LAYERS[name]
    gen = torch.Generator().manual_seed(1)
    num_blocks = 512 // block_size
    cache = torch.randn(2, num_blocks, block_size, 2, 32, generator=gen)
    tables = [torch.randperm(num_blocks, generator=gen)[: 128 // block_size].tolist() for _ in range(4)]
    chunks = [(0, 40, tables[0]), (60, 30, tables[1]), (99, 1, tables[2]), (0, 3, tables[3])]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = build_attention_metadata(chunks, block_size, [cache.to(device)], device, "triton", (), block_q)
    assert meta.prefill_batch is not None
    q = torch.randn(sum(n for _, n, _ in chunks), 8, 32, generator=gen)
    out = torch.full_like(q, 7.0).to(device)
    sinks = None if layer.sinks is None else layer.sinks.to(device)
    triton_attention.paged_prefill_attention(
        q.to(device),
        cache.to(device),
        meta.prefill_batch,
        0.2,
        out,
        layer.window or 0,
        layer.softcap or 0.0,
        sinks,
    )
    out = out.cpu()
    row = 0
    for start, n, table in chunks:
        for i in range(n):
            if n == 1:  # the decode row: not the one launch's
                assert bool((out[row] == 7.0).all())
            else:
                expected = _reference(q[row], cache, table, start + i + 1, 0.2, layer)
                torch.testing.assert_close(out[row], expected, atol=1e-4, rtol=1e-4)
            row += 1
