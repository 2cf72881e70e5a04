"""The native kernel's bf16 decode equals PyTorch's CPU SDPA (flash kernel) bit for bit.

That is what transformers' sdpa attention computes at a decode step, so it is what bf16
greedy parity with ``generate`` needs (test_bf16_parity.py). The kernel reproduces the
flash kernel's float32 operation order (csrc/paged_decode.c): ATen's fexp_u20, its lane
sums, and oneDNN's bf16 gemv order as measured on avx512_bf16 CPUs without AMX. Other
ISAs run other oneDNN kernels, so the exactness is asserted only where it was verified.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc.engine import cpu_attention
from worker_svc.engine.config import cpu_flags

KERNEL = cpu_attention.load()
pytestmark = [
    pytest.mark.skipif(KERNEL is None, reason="no C compiler: native CPU attention unavailable"),
    pytest.mark.skipif(
        not cpu_attention.exact_bf16_verified(cpu_flags()),
        reason="bit-exactness with the flash kernel is verified on avx512_bf16 CPUs without AMX only",
    ),
]
LENGTHS = [1, 5, 15, 16, 17, 63, 64, 65, 131, 200, 512, 513, 1100]


def _case(
    heads: int, kv_heads: int, head_dim: int, length: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """q ``[1, H, 1, D]``, K and V ``[1, Hkv, L, D]`` (bf16), written into a paged cache at
    scattered blocks (garbage elsewhere); returns q, the cache, K/V stacked, the table."""
    bs = 16
    nblocks = -(-length // bs)
    q = torch.randn(1, heads, 1, head_dim, generator=gen).to(torch.bfloat16)
    kv = (torch.randn(2, 1, kv_heads, length, head_dim, generator=gen) * 2).to(torch.bfloat16)
    cache = torch.randn(2, nblocks + 5, bs, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    table = torch.randperm(nblocks + 5, generator=gen)[:nblocks].tolist()
    slots = (torch.tensor(table)[:, None] * bs + torch.arange(bs)).flatten()[:length]
    flat = cache.view(2, -1, kv_heads, head_dim)
    flat[:, slots] = kv[:, 0].transpose(1, 2)
    return q, cache, kv, table


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (4, 2, 64), (8, 2, 128), (4, 1, 32)])
def test_bf16_decode_is_bit_identical_to_sdpa(heads: int, kv_heads: int, head_dim: int) -> None:
    """Lengths around the 4-key groups, the 16-lane vectors and the 512-key blocks."""
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    for length in LENGTHS:
        q, cache, kv, table = _case(heads, kv_heads, head_dim, length, gen)
        expected = F.scaled_dot_product_attention(q, kv[0], kv[1], scale=scale, enable_gqa=heads != kv_heads)
        q_rows = q[0].transpose(0, 1).contiguous()  # [1, H, D]: one decode row
        out = torch.empty_like(q_rows)
        tables = torch.tensor([table], dtype=torch.int32)
        KERNEL(
            q_rows, cache, tables, torch.tensor([length], dtype=torch.int32), torch.tensor([0]), out, scale
        )
        got = out.transpose(0, 1).unsqueeze(0)
        mismatches = int((got != expected).sum())
        assert mismatches == 0, f"length {length}: {mismatches} of {got.numel()} values differ"


def test_exactness_is_claimed_only_where_verified() -> None:
    assert cpu_attention.exact_bf16_verified(frozenset({"avx512f", "avx512_bf16"}))
    assert not cpu_attention.exact_bf16_verified(frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert not cpu_attention.exact_bf16_verified(frozenset({"avx2"}))
