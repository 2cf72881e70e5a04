"""The Triton paged-decode kernel with per-layer attention (sliding window, logit
softcapping, attention sinks) against the dense reference of test_cpu_attention_layers.

Natively on a GPU; on CPU only under TRITON_INTERPRET=1 (test_arch_matrix runs this file
in a child pytest with it set)."""

from __future__ import annotations

import pytest
import torch

from tests.worker_engine.test_cpu_attention_layers import LAYERS, _case, _reference
from worker_svc.engine import triton_attention

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
