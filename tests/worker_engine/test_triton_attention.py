"""Triton kernels vs the torch path.

On a GPU they run natively; without one, under TRITON_INTERPRET=1 they run on CPU
tensors through Triton's interpreter (test_triton_interpret.py runs this module so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.worker_engine.conftest import prompts, run_all, tokens
from worker_svc.engine import LLMEngine, SamplingParams, attention, triton_attention
from worker_svc.engine.attention import build_attention_metadata, paged_attention_forward, store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cpu" and not triton_attention.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
    ),
    pytest.mark.skipif(not triton_attention.HAS_TRITON, reason="needs triton"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_torch(dtype: torch.dtype) -> None:
    dev = torch.device(DEVICE)
    cache_a = torch.zeros(2, 10, 16, 2, 64, dtype=dtype, device=dev)
    cache_b = cache_a.clone()
    k = torch.randn(7, 2, 64, device=dev, dtype=dtype)
    v = torch.randn(7, 2, 64, device=dev, dtype=dtype)
    slots = torch.tensor([3, 17, 18, 40, 159, 0, 100], device=dev)
    store_kv(k, v, cache_a, slots)
    triton_attention.store_kv(k, v, cache_b, slots)
    torch.testing.assert_close(cache_a, cache_b, rtol=0, atol=0)


# Triton's interpreter multiplies bf16 matrices wrongly (garbage where fp16's products are
# right), so bf16 caches are checked on a GPU only.
CACHE_DTYPES = [torch.float32, torch.float16] + [torch.bfloat16] * (DEVICE == "cuda")


@pytest.mark.parametrize("num_splits", [None, 1, 3, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (8, 8, 64), (12, 4, 80)])
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_paged_decode_matches_torch(
    heads: int, kv_heads: int, head_dim: int, num_splits: int | None, dtype: torch.dtype
) -> None:
    """Float32 caches exactly (no TF32); 16-bit ones as the torch path gives them, within
    the rounding of the probabilities to 16 bits (as flash attention's kernels round them)."""
    dev = torch.device(DEVICE)
    torch.manual_seed(0)
    bs, nb = 16, 64
    cache = torch.randn(2, nb, bs, kv_heads, head_dim, device=dev).to(dtype)
    lens = [1, 15, 16, 17, 100, 250]
    perm = torch.randperm(nb).tolist()
    tables, used = [], 0
    for n in lens:
        k = -(-n // bs)
        tables.append(perm[used : used + k])
        used += k
    scale = head_dim**-0.5
    q = torch.randn(len(lens), heads, head_dim, device=dev).to(dtype)
    meta = build_attention_metadata(
        [(n - 1, 1, t) for n, t in zip(lens, tables, strict=True)], bs, [cache], dev, "torch"
    )
    meta_t = build_attention_metadata(
        [(n - 1, 1, t) for n, t in zip(lens, tables, strict=True)], bs, [cache], dev, "triton"
    )
    assert meta_t.decode_block_tables is not None and meta_t.decode_seq_lens is not None
    out_t = triton_attention.paged_decode_attention(
        q, cache, meta_t.decode_block_tables, meta_t.decode_seq_lens, scale, num_splits=num_splits
    )

    class Layer(torch.nn.Module):
        layer_idx = 0

    # Torch path through the public attention function (it also re-stores the given K/V).
    flat = cache.view(2, nb * bs, kv_heads, head_dim)
    k_new = flat[0][meta.slot_mapping].unsqueeze(0).transpose(1, 2)
    v_new = flat[1][meta.slot_mapping].unsqueeze(0).transpose(1, 2)
    ref, _ = paged_attention_forward(
        Layer(),
        q.unsqueeze(0).transpose(1, 2),
        k_new,
        v_new,
        None,
        scaling=scale,
        meshserve_attn_metadata=meta,
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_t.float(), ref[0].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("budget", [None, 24], ids=["whole-prompts", "chunked"])
def test_engine_greedy_same_with_triton_backend(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    """Same tokens as the torch backend, whole prompts in a step and, with a small token
    budget, chunks continuing cached context beside decoding rows; every prefill chunk is
    attended by the one launch."""
    ps = prompts(5, 30, 47, seed=31)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(ps)]
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget}
    torch_out = run_all(make_engine(device=DEVICE, attention_backend="torch", **kwargs), reqs)
    engine = make_engine(device=DEVICE, attention_backend="triton", **kwargs)
    assert engine.model_info.attention_backend == "triton"
    launches: list[int] = []
    one_launch = triton_attention.paged_prefill_attention

    def counted(q: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        launches.append(args[1].q_starts.numel())
        return one_launch(q, *args, **kw)

    monkeypatch.setattr(triton_attention, "paged_prefill_attention", counted)
    monkeypatch.setattr(attention, "_prefill_torch", None)  # the per-chunk path must not run
    triton_out = run_all(engine, reqs)
    assert {k: tokens(v) for k, v in triton_out.items()} == {k: tokens(v) for k, v in torch_out.items()}
    layers = engine.model_info.num_layers
    assert launches and len(launches) % layers == 0
    if budget is not None:
        assert len(launches) > layers, "the prompts were not chunked"


# (tokens cached before the step, new tokens): a fresh prompt longer than a tile of queries,
# a chunk continuing cached context past a tile of keys, a decode row, a short prompt.
CHUNKS = [(0, 37), (70, 9), (19, 1), (0, 3)]


def _causal_reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], group: int
) -> torch.Tensor:
    """float64 causal attention of each sequence's rows of ``q`` over its keys/values."""
    out, row = [], 0
    for (cached, new), k, v in zip(CHUNKS, keys, values, strict=True):
        qs = q[row : row + new].double().transpose(0, 1)  # [H, new, D]
        kk = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, D]
        vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
        scores = qs @ kk.transpose(1, 2) * q.shape[-1] ** -0.5
        allowed = torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out.append((probs @ vv).transpose(0, 1))
        row += new
    return torch.cat(out)


@pytest.mark.parametrize("block_q", sorted(triton_attention.PREFILL_WARPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_launch_prefill_equals_causal_attention_per_sequence(dtype: torch.dtype, block_q: int) -> None:
    """The prompt chunks' rows equal float64 causal attention over each sequence's context
    (blocks scattered over the cache); the decode row's is left as it was."""
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-(c + n) // bs) for c, n in CHUNKS) + 3
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, keys, values = [], [], []
    for cached, new in CHUNKS:
        blocks = [order.pop() for _ in range(-(-(cached + new) // bs))]
        tables.append(blocks)
        flat = cache[:, blocks].reshape(2, -1, kv_heads, dim)[:, : cached + new]
        keys.append(flat[0])
        values.append(flat[1])
    q = torch.randn(sum(n for _, n in CHUNKS), heads, dim, generator=gen).to(dtype)
    want = _causal_reference(q, keys, values, heads // kv_heads)
    dev = torch.device(DEVICE)
    chunks = [(c, n, t) for (c, n), t in zip(CHUNKS, tables, strict=True)]
    meta = build_attention_metadata(chunks, bs, [cache.to(dev)], dev, "triton", (), block_q)
    assert meta.prefill_batch is not None and meta.prefill_batch.q_starts.tolist() == [0, 37, 47]
    out = torch.full(q.shape, 7.0, dtype=dtype, device=dev)
    triton_attention.paged_prefill_attention(q.to(dev), cache.to(dev), meta.prefill_batch, dim**-0.5, out)
    prompt_rows = [r for r in range(q.shape[0]) if r != 46]  # row 46: the decode row
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out[prompt_rows].double().cpu(), want[prompt_rows], rtol=tol, atol=tol)
    assert bool((out[46] == 7.0).all())
    # Queries laid out [T, D, H] (head_dim not the innermost): the same answer.
    strided = q.to(dev).transpose(1, 2).contiguous().transpose(1, 2)
    again = triton_attention.paged_prefill_attention(strided, cache.to(dev), meta.prefill_batch, dim**-0.5)
    torch.testing.assert_close(again[prompt_rows], out[prompt_rows], rtol=0, atol=0)


def test_split_decode_reads_and_writes_only_the_decode_rows() -> None:
    """Decode rows among prefill rows: each sequence reads its row of q and writes the same
    row of out, split or not, and leaves the other rows as they were."""
    dev = torch.device(DEVICE)
    torch.manual_seed(1)
    bs, nb, heads, kv_heads, head_dim = 16, 32, 4, 2, 32
    cache = torch.randn(2, nb, bs, kv_heads, head_dim, device=dev)
    chunks = [(99, 1, list(range(0, 7))), (40, 1, list(range(7, 10))), (200, 1, list(range(10, 23)))]
    meta = build_attention_metadata(chunks, bs, [cache], dev, "triton")
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    q = torch.randn(3, heads, head_dim, device=dev)
    whole = triton_attention.paged_decode_attention(
        q, cache, meta.decode_block_tables, meta.decode_seq_lens, 0.3, num_splits=1
    )
    rows = torch.tensor([5, 1, 3], device=dev)
    wide_q = torch.randn(6, heads, head_dim, device=dev)
    wide_q[rows] = q
    for splits in (1, 4):
        out = torch.full((6, heads, head_dim), 7.0, device=dev)
        triton_attention.paged_decode_attention(
            wide_q, cache, meta.decode_block_tables, meta.decode_seq_lens, 0.3, rows=rows, out=out,
            num_splits=splits,
        )  # fmt: skip
        torch.testing.assert_close(out[rows], whole, rtol=1e-5, atol=1e-5)
        assert bool((out[[0, 2, 4]] == 7.0).all())


def test_splits_fill_the_device_only_where_programs_are_few() -> None:
    cpu = torch.device("cpu")  # the interpreter stands in for a GPU of 8 multiprocessors
    assert triton_attention.split_count(2, 64, 16, cpu) == 8  # two programs: 8 splits make 16
    assert triton_attention.split_count(5, 64, 16, cpu) == 4  # ceil(16 / 5)
    assert triton_attention.split_count(16, 64, 16, cpu) == 1  # already two per multiprocessor
    assert triton_attention.split_count(2, 23, 16, cpu) == 6  # a split covers at least one tile of keys
    assert triton_attention.split_count(2, 1, 16, cpu) == 1
    assert triton_attention.tile_blocks(16) == 4 and triton_attention.tile_blocks(128) == 1
