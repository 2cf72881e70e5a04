"""Paged attention plugged into ``transformers`` models.

The runner flattens all scheduled sequences of a step into one packed batch
(``input_ids``/``position_ids`` of shape ``[1, T]``). Each sequence contributes
``q_len`` new tokens (a prefill chunk, or 1 for decode) that attend causally to the
sequence's whole context, read from the paged KV cache through its block table.

KV cache, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(0 = keys, 1 = values); token at position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Integration with transformers 5.x (checked against 5.18):

* ``AttentionInterface.register(ATTN_IMPL_NAME, paged_attention_forward)`` and
  ``from_pretrained(..., attn_implementation=ATTN_IMPL_NAME)``.
* The name is not in the *mask* interface, so ``masking_utils._preprocess_mask_arguments``
  exits early and the model passes ``attention_mask=None``: no O(T^2) mask is built
  for the packed batch; masking is done here, per sequence.
* Metadata reaches this function through a ``ContextVar`` set by the runner
  (:func:`attention_context`). Extra ``model(**kwargs)`` are also forwarded down to
  attention by Llama-style models (kwarg ``meshserve_attn_metadata`` is honoured), but
  not every architecture forwards them, so the context is the primary channel.
* The function receives the attention ``module`` (``module.layer_idx`` selects the
  layer's cache) and ``query [1, H, T, D]``, ``key/value [1, Hkv, T, D]`` after RoPE;
  it returns ``[1, T, H, D]`` like transformers' SDPA integration.

Per-layer attention (Mistral, Gemma 2/3, gpt-oss, ...): ``AttentionMetadata.layer_windows``
(from :mod:`worker_svc.engine.arch`) gives each layer's sliding window -- a query at
position ``p`` sees keys ``p - window < k <= p``, as transformers' sliding mask -- and the
layer's ``softcap`` (tanh logit capping) and ``s_aux`` (attention sinks: one extra logit
per head in the softmax denominator) arrive as keyword arguments. Such a layer runs on
torch (prefill chunks) on every backend (:func:`_attend_dense`: SDPA for a window only,
explicit softmax with softcap/sinks), reading only the blocks that hold its window; its
decode rows run in the native CPU or Triton decode kernel (both take window, softcap and
sinks) or, on the torch backend, in :func:`_decode_layer`. Keyword arguments outside
:data:`KNOWN_KWARGS` are an error, never ignored.

Decode rows (q_len == 1), by backend: ``cpu`` — the native kernel of
:mod:`worker_svc.engine.cpu_attention` reads K/V in place through the block tables (in
bf16 with the rounding of torch's CPU flash kernel: bit-identical to SDPA where verified);
``torch`` (fallback) — one gather + one padded SDPA call for all of them; ``sdpa`` —
one SDPA call per sequence over exactly its own keys, no mask: the call transformers'
sdpa attention makes at a decode step, so bf16 results are bit-identical to it on any
CPU (padding and masks change the flash kernel's rounding), but several times slower
than the native kernel (one call per sequence and layer);
``triton`` (CUDA). Prefill chunks: on ``triton``, every chunk of a step in one launch per
layer, windows, softcap and sinks included (``triton_attention.paged_prefill_attention``,
:attr:`AttentionMetadata.prefill_batch`); on the other backends one SDPA per chunk
(``is_causal`` when the chunk starts at position 0, otherwise an explicit causal mask
offset by the chunk start; :func:`_prefill_layer` for per-layer attention). GQA via
``enable_gqa``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from worker_svc.engine import cpu_attention
from worker_svc.engine.host_copy import tensor_on, to_device

if TYPE_CHECKING:
    from worker_svc.engine.triton_attention import PrefillBatch

__all__ = [
    "ATTN_IMPL_NAME",
    "KNOWN_KWARGS",
    "METADATA_KWARG",
    "AttentionMetadata",
    "PrefillChunk",
    "attention_context",
    "build_attention_metadata",
    "paged_attention_forward",
    "register_paged_attention",
    "store_kv",
]

ATTN_IMPL_NAME = "meshserve_paged"
METADATA_KWARG = "meshserve_attn_metadata"

# Keyword arguments transformers' attention modules pass that this function understands:
# honoured (scaling, sliding_window, softcap, s_aux), or harmless when given (dropout must
# be 0, the rest carry nothing attention needs). Anything else is refused, see _check_kwargs.
KNOWN_KWARGS = frozenset(
    {
        "dropout",
        "scaling",
        "sliding_window",
        "softcap",
        "s_aux",
        "position_ids",
        "cache_position",
        "output_attentions",
        "use_cache",
        "is_causal",
        "head_mask",
        "output_router_logits",  # MoE models forward their model kwargs down to attention
        "output_hidden_states",
        "return_dict",
        METADATA_KWARG,
    }
)


@dataclass
class PrefillChunk:
    """A sequence with ``q_len > 1`` new tokens at packed rows ``[token_start, token_end)``;
    ``blocks``: the ids of the blocks covering its context (empty when the chunk starts at
    position 0: the fresh K/V *are* the whole context). Its tensors for the per-chunk torch
    path are made on first use: the Triton backend attends every chunk in one launch
    (:attr:`AttentionMetadata.prefill_batch`) and never needs them."""

    token_start: int
    token_end: int
    context_len: int
    blocks: Sequence[int]
    device: torch.device

    @functools.cached_property
    def context_blocks(self) -> torch.Tensor | None:
        """``[num_blocks]`` block ids covering the context (None for a fresh prompt)."""
        return tensor_on(self.blocks, self.device, torch.long) if self.blocks else None

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """``[q_len, context_len]`` bool, True = attend (None for a fresh prompt: causal)."""
        if not self.blocks:
            return None
        # Query i sits at absolute position start + i and sees keys 0..start + i.
        start = self.context_len - (self.token_end - self.token_start)
        q_pos = torch.arange(start, self.context_len, device=self.device).unsqueeze(1)
        return torch.arange(self.context_len, device=self.device).unsqueeze(0) <= q_pos


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step (shared by all layers)."""

    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] slot of every new token
    decode_token_idx: torch.Tensor | None = None  # [Bd] packed rows of decode sequences
    decode_blocks: torch.Tensor | None = None  # [Bd * max_blocks] block ids (padding -> block 0)
    decode_bias: torch.Tensor | None = None  # [Bd, 1, 1, max_blocks * block_size] additive 0 / -inf
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] int32 (triton, cpu)
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int32 (triton, cpu)
    decode_table: torch.Tensor | None = None  # [Bd, max_blocks] int64 (every backend: windowed layers)
    decode_lens: torch.Tensor | None = None  # [Bd] int64
    # sdpa backend: (packed row, sequence length, its blocks) of every decode sequence
    decode_seqs: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # triton: every prefill chunk for one launch per layer (None: no chunk, or another backend)
    prefill_batch: PrefillBatch | None = None
    backend: str = "torch"
    # Sliding window of each layer (None = full attention); empty = every layer full.
    layer_windows: Sequence[int | None] = ()
    # Set by the runner's load-time probe: layer index -> calls of the attention function.
    probe: dict[int, int] | None = None


_CURRENT: ContextVar[AttentionMetadata | None] = ContextVar("meshserve_attn_metadata", default=None)


@contextlib.contextmanager
def attention_context(meta: AttentionMetadata) -> Iterator[None]:
    """Make ``meta`` visible to :func:`paged_attention_forward` during a forward pass."""
    token = _CURRENT.set(meta)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def register_paged_attention() -> None:
    """Register :data:`ATTN_IMPL_NAME` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL_NAME, paged_attention_forward)


def build_attention_metadata(
    chunks: Sequence[tuple[int, int, Sequence[int]]],
    block_size: int,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    backend: str = "torch",
    layer_windows: Sequence[int | None] = (),
    prefill_block_q: int = 16,
) -> AttentionMetadata:
    """Metadata for a packed batch of ``(start_position, q_len, block_table)`` chunks;
    ``layer_windows`` as :attr:`AttentionMetadata.layer_windows`; ``prefill_block_q``:
    queries per program of the triton backend's prefill (``triton_attention.prefill_block_q``).
    Its tensors are views of host-to-device copies that do not wait for the device
    (:func:`host_copy.to_device`)."""
    slot_list: list[int] = []
    dec_rows: list[int] = []
    dec_tables: list[Sequence[int]] = []
    dec_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    seqs: list[tuple[int, int, int, Sequence[int]]] = []  # the prefill chunks' (row, start, q_len, table)
    row = 0
    for start, q_len, table in chunks:
        end = start + q_len
        if q_len == 1:
            slot_list.append(table[start // block_size] * block_size + start % block_size)
            dec_rows.append(row)
            dec_tables.append(table)
            dec_lens.append(end)
        else:
            slot_list.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            blocks = table[: -(-end // block_size)] if start else ()
            prefills.append(PrefillChunk(row, row + q_len, end, blocks, device))
            seqs.append((row, start, q_len, table))
        row += q_len
    lists: dict[str, Sequence[int]] = {"slots": slot_list}
    if dec_rows:
        lists.update(_decode_lists(dec_rows, dec_tables, dec_lens, block_size))
    sent = to_device(lists, device)
    meta = AttentionMetadata(
        kv_caches=kv_caches, slot_mapping=sent["slots"], prefills=prefills, backend=backend,
        layer_windows=layer_windows,
    )  # fmt: skip
    if dec_rows:
        _fill_decode(meta, sent, dec_rows, dec_lens, block_size, device)
    if backend == "triton" and seqs:
        from worker_svc.engine import triton_attention

        fields, width = triton_attention.prefill_fields(seqs, block_size, prefill_block_q)
        batch = to_device(fields, device, torch.int32)
        batch["block_tables"] = batch["block_tables"].view(-1, width)
        meta.prefill_batch = triton_attention.PrefillBatch(**batch, block_q=prefill_block_q)
    return meta


def every_row(rows: Sequence[int]) -> bool:
    """Whether strictly increasing ``rows`` are every row from 0 (an arange: nothing to send)."""
    return bool(rows) and rows[0] == 0 and rows[-1] == len(rows) - 1


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """``rows`` (strictly increasing) as a long tensor: ``arange`` when they are every row
    from 0 (a decode step's rows and kept logits), without reading a Python list."""
    if every_row(rows):
        return torch.arange(len(rows), dtype=torch.long, device=device)
    return tensor_on(rows, device, torch.long)


def _decode_lists(
    rows: list[int], tables: list[Sequence[int]], lens: list[int], block_size: int
) -> dict[str, list[int]]:
    """The decode rows' block tables (one flat row-major list, padded with block 0 to the
    longest), context lengths and packed rows (unless every row from 0), for
    :func:`_fill_decode`."""
    max_blocks = -(-max(lens) // block_size)
    flat: list[int] = []
    zeros = [0] * max_blocks
    for t in tables:
        flat.extend(t[:max_blocks])
        flat.extend(zeros[: max_blocks - min(len(t), max_blocks)])
    out = {"dec_tables": flat, "dec_lens": lens}
    if not every_row(rows):
        out["dec_rows"] = rows
    return out


def _fill_decode(
    meta: AttentionMetadata,
    sent: dict[str, torch.Tensor],
    rows: list[int],
    lens: list[int],
    block_size: int,
    device: torch.device,
) -> None:
    table_t = sent["dec_tables"].view(len(rows), -1)
    lens_t = sent["dec_lens"]
    meta.decode_token_idx = sent["dec_rows"] if "dec_rows" in sent else row_index(rows, device)
    meta.decode_table, meta.decode_lens = table_t, lens_t
    if meta.backend in ("triton", "cpu"):
        meta.decode_block_tables = table_t.to(torch.int32)
        meta.decode_seq_lens = lens_t.to(torch.int32)
        return
    if meta.backend == "sdpa":
        meta.decode_seqs = [
            (row, n, table_t[i, : -(-n // block_size)])
            for i, (row, n) in enumerate(zip(rows, lens, strict=True))
        ]
        return
    meta.decode_blocks = table_t.flatten()
    valid = torch.arange(table_t.shape[1] * block_size, device=device).unsqueeze(0) < lens_t.unsqueeze(1)
    # An additive float mask is measurably faster than a bool one in CPU SDPA.
    bias = torch.zeros(valid.shape, dtype=meta.kv_caches[0].dtype, device=device)
    meta.decode_bias = bias.masked_fill_(~valid, float("-inf"))[:, None, None, :]


def store_kv(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key/value [T, Hkv, D]`` into ``cache [2, nb, bs, Hkv, D]`` at ``slot_mapping [T]``."""
    _, nb, bs, hkv, d = cache.shape
    flat = cache.view(2, nb * bs, hkv, d)
    flat[0].index_copy_(0, slot_mapping, key.to(cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(cache.dtype))


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole blocks, ``[len(blocks) * block_size, Hkv, D]`` each.

    Gathering block rows (``index_select`` over contiguous block_size*Hkv*D chunks) is
    markedly faster on CPU than gathering per-token slots.
    """
    _, nb, bs, hkv, d = cache.shape
    flat = cache.view(2, nb, bs * hkv * d)
    k = flat[0].index_select(0, blocks).view(-1, hkv, d)
    v = flat[1].index_select(0, blocks).view(-1, hkv, d)
    return k, v


def _decode_torch(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decode rows ``q [Bd, H, D]`` -> ``[Bd, H, D]`` with one padded SDPA call.

    GQA without replicating K/V: the ``H // Hkv`` query heads sharing a KV head are laid
    out as that head's "query positions" (``[Bd, Hkv, G, D]``); with one new token per
    sequence they all see the same keys, so the (broadcast) mask is shared.
    """
    if meta.decode_blocks is None or meta.decode_bias is None:
        raise RuntimeError("decode metadata missing for the torch backend")
    batch, heads, head_dim = q.shape
    hkv = cache.shape[3]
    k, v = _gather_blocks(cache, meta.decode_blocks)
    k = k.view(batch, -1, hkv, head_dim).transpose(1, 2)  # [Bd, Hkv, L, D]
    v = v.view(batch, -1, hkv, head_dim).transpose(1, 2)
    qg = q.reshape(batch, hkv, heads // hkv, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_bias, scale=scale)
    return out.reshape(batch, heads, head_dim)


def _decode_sdpa(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
) -> None:
    """Decode rows of ``q [T, H, D]`` into ``out``, one SDPA call per sequence over exactly
    its keys and no mask: what transformers' sdpa attention computes at a decode step
    (DynamicCache: ``[1, H, 1, D]`` over ``[1, Hkv, L, D]``, ``enable_gqa``). On CPU the
    flash kernel's result depends on L and on a mask (its exp and sums split keys into
    16-lane vectors plus a scalar tail; oneDNN's gemv order depends on L), so any padding
    to the batch's longest sequence breaks bit parity."""
    _, nb, bs, hkv, d = cache.shape
    flat = cache.view(2, nb, bs * hkv * d)
    heads = q.shape[1]
    gqa = heads != hkv
    for row, n, blocks in meta.decode_seqs:
        k = flat[0].index_select(0, blocks).view(-1, hkv, d)[:n].transpose(0, 1).unsqueeze(0)
        v = flat[1].index_select(0, blocks).view(-1, hkv, d)[:n].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q[row].view(1, heads, 1, d), k, v, scale=scale, enable_gqa=gqa)
        out[row] = o.view(heads, d)


def _prefill_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    """One chunk: ``q [q_len, H, D]`` (and its fresh ``k/v``) -> ``[q_len, H, D]``."""
    gqa = q.shape[1] != k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)
    if chunk.context_blocks is None:
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        kc, vc = _gather_blocks(cache, chunk.context_blocks)
        kh = kc[: chunk.context_len].transpose(0, 1).unsqueeze(0)
        vh = vc[: chunk.context_len].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=chunk.mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    layer: LayerAttention | None = None,
) -> None:
    """Attention of the decode rows of ``q [T, H, D]`` into the same rows of ``out``.

    ``layer`` (window / softcap / sinks) is served by the native CPU and Triton kernels;
    the torch backend gets plain layers here (the others go to :func:`_decode_layer`)."""
    rows = meta.decode_token_idx
    if rows is None:
        return
    layer = layer or LayerAttention()
    if meta.backend in ("torch", "sdpa") and not layer.plain:
        raise RuntimeError("the torch decode paths here serve plain causal layers only (see _decode_layer)")
    if meta.backend == "sdpa":
        _decode_sdpa(q, cache, meta, scale, out)
        return
    if meta.backend == "torch":
        od = _decode_torch(q.index_select(0, rows), cache, meta, scale)
        out.index_copy_(0, rows, od.to(out.dtype))
        return
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    if tables is None or lens is None:
        raise RuntimeError(f"decode metadata missing for the {meta.backend} backend")
    if meta.backend == "cpu":
        kernel = cpu_attention.load()
        if kernel is None:
            raise RuntimeError("the cpu attention backend was chosen but its kernel did not load")
        kernel(q, cache, tables, lens, rows, out, scale, layer.window or 0, layer.softcap or 0.0, layer.sinks)
        return
    from worker_svc.engine import triton_attention

    # The kernel reads and writes the decode rows in place: no gather or scatter around it.
    triton_attention.paged_decode_attention(
        q,
        cache,
        tables,
        lens,
        scale,
        layer.window or 0,
        layer.softcap or 0.0,
        layer.sinks,
        rows=rows,
        out=out,
    )


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention adds to plain causal softmax attention."""

    window: int | None = None  # sliding window (see module docstring)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None  # [H] one extra logit per head in the softmax

    @property
    def plain(self) -> bool:
        """True for full causal attention without softcap or sinks (every kernel serves it)."""
        return self.window is None and self.softcap is None and self.sinks is None


def _check_kwargs(
    layer_idx: int, kwargs: dict[str, Any], dropout: float, attention_mask: torch.Tensor | None
) -> None:
    """Refuse what this function would otherwise silently ignore (wrong tokens)."""
    if attention_mask is not None:
        # transformers' masking_utils pass None for this implementation (module docstring):
        # a mask here was built by the model itself, encoding who knows what.
        raise RuntimeError(
            f"{ATTN_IMPL_NAME}: layer {layer_idx} was given an attention mask the model built itself"
        )
    if kwargs.get("is_causal") is False:
        raise RuntimeError(
            f"{ATTN_IMPL_NAME}: layer {layer_idx} asks for non-causal (bidirectional) attention"
        )
    unknown = sorted(k for k, v in kwargs.items() if k not in KNOWN_KWARGS and v is not None)
    if unknown:
        raise RuntimeError(
            f"{ATTN_IMPL_NAME}: layer {layer_idx} passed attention arguments it cannot honour: {unknown}"
        )
    if dropout:
        raise RuntimeError(f"{ATTN_IMPL_NAME}: attention dropout {dropout} (the model is in training mode)")


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over the packed batch (see module docstring)."""
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise RuntimeError(f"attention module {type(module).__name__} has no layer_idx")
    _check_kwargs(layer_idx, kwargs, dropout, attention_mask)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # 0 / 0.0 stand for "not given": the custom op's schema has no optional scalars here.
    kw_window = int(kwargs.get("sliding_window") or 0)
    softcap = float(kwargs.get("softcap") or 0.0)
    sinks = kwargs.get("s_aux")
    if torch.compiler.is_compiling():
        # Opaque to the compiler: the metadata (Python lists, ContextVar) is read at run time.
        out = torch.ops.meshserve.paged_attention(
            query, key, value, layer_idx, scale, kw_window, softcap, sinks
        )
        return out, None
    meta = kwargs.get(METADATA_KWARG) or _CURRENT.get()
    if meta is not None and meta.probe is not None:
        meta.probe[layer_idx] = meta.probe.get(layer_idx, 0) + 1
    return _attend(meta, layer_idx, query, key, value, scale, kw_window, softcap, sinks), None


@torch.library.custom_op("meshserve::paged_attention", mutates_args=())
def _paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    kw_window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Compiled-graph entry: :func:`_attend` with the metadata of :func:`attention_context`."""
    return _attend(_CURRENT.get(), layer_idx, query, key, value, scale, kw_window, softcap, sinks)


@_paged_attention_op.register_fake
def _(query: torch.Tensor, *_: object) -> torch.Tensor:
    """The op's output for compilation, ``[1, T, H, D]`` for ``query [1, H, T, D]``: only
    the query's shape decides it, not the op's other arguments."""
    _, heads, tokens, head_dim = query.shape
    return query.new_empty((1, tokens, heads, head_dim))


_PLAIN = LayerAttention()


def _layer(
    meta: AttentionMetadata, layer_idx: int, kw_window: int, softcap: float, sinks: torch.Tensor | None
) -> LayerAttention:
    """This layer's attention: the window from the model's spec, checked against the one
    the module passed (a disagreement means the spec misread the model: refuse)."""
    window = meta.layer_windows[layer_idx] if meta.layer_windows else None
    if window is None and not kw_window and not softcap and sinks is None:
        return _PLAIN  # the common case, without building a dataclass per layer and step
    if kw_window and kw_window != window:
        raise RuntimeError(
            f"{ATTN_IMPL_NAME}: layer {layer_idx} passed sliding_window={kw_window} but the model's "
            f"config gives {window}"
        )
    return LayerAttention(window, softcap or None, sinks)


def _attend(
    meta: AttentionMetadata | None,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    kw_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's K/V in the paged cache and attend: ``query [1, H, T, D]`` -> ``[1, T, H, D]``."""
    if meta is None:
        raise RuntimeError(f"{ATTN_IMPL_NAME} attention called outside the meshserve model runner")
    layer = _layer(meta, layer_idx, kw_window, softcap, sinks)
    cache = meta.kv_caches[layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    if meta.backend == "triton":
        from worker_svc.engine import triton_attention

        triton_attention.store_kv(k, v, cache, meta.slot_mapping)
    else:
        store_kv(k, v, cache, meta.slot_mapping)
    # Contiguous [T, H, D] (not q's transposed strides): the caller's reshape is then a view.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.decode_token_idx is not None:
        if layer.plain or meta.backend not in ("torch", "sdpa"):
            _decode(q, cache, meta, scale, out, layer)
        else:
            rows = meta.decode_token_idx
            od = _decode_layer(q.index_select(0, rows), cache, meta, scale, layer)
            out.index_copy_(0, rows, od.to(out.dtype))
    if meta.prefill_batch is not None:
        from worker_svc.engine import triton_attention

        triton_attention.paged_prefill_attention(
            q, cache, meta.prefill_batch, scale, out, layer.window or 0, layer.softcap or 0.0, layer.sinks
        )
        return out.unsqueeze(0)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_end
        if layer.plain:
            out[s:e] = _prefill_torch(q[s:e], k[s:e], v[s:e], cache, chunk, scale)
        else:
            out[s:e] = _prefill_layer(q[s:e], k[s:e], v[s:e], cache, chunk, scale, layer)
    return out.unsqueeze(0)


def _attend_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    layer: LayerAttention,
) -> torch.Tensor:
    """``q [B, H, Lq, D]`` over ``k/v [B, Hkv, L, D]`` where ``allowed [B|1, 1, Lq, L]``.

    A window alone is only a mask: SDPA. Softcap and sinks change the softmax itself, so
    the scores are computed explicitly, like transformers' eager attention (softmax in
    float32; a sink is an extra logit per head whose probability is dropped).
    """
    if layer.softcap is None and layer.sinks is None:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if layer.sinks is not None:
        sink = layer.sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def _decode_layer(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, layer: LayerAttention
) -> torch.Tensor:
    """Decode rows ``q [Bd, H, D]`` of a windowed / softcapped / sink layer -> ``[Bd, H, D]``.

    A windowed layer reads only the blocks holding its window (at most
    ``ceil(window / block_size) + 1`` per sequence), so its cost does not grow with the context.
    """
    table, lens = meta.decode_table, meta.decode_lens
    if table is None or lens is None:
        raise RuntimeError("decode metadata missing")
    batch, _, head_dim = q.shape
    _, _, bs, hkv, _ = cache.shape
    max_blocks = table.shape[1]
    if layer.window is not None:
        first = (lens - layer.window).clamp(min=0) // bs
        span = min(max_blocks, -(-layer.window // bs) + 1)
    else:
        first, span = torch.zeros_like(lens), max_blocks
    cols = first.unsqueeze(1) + torch.arange(span, device=q.device)  # [Bd, span]
    blocks = table.gather(1, cols.clamp(max=max_blocks - 1))
    k, v = _gather_blocks(cache, blocks.flatten())
    k = k.view(batch, span * bs, hkv, head_dim).transpose(1, 2)  # [Bd, Hkv, L, D]
    v = v.view(batch, span * bs, hkv, head_dim).transpose(1, 2)
    pos = (cols.unsqueeze(2) * bs + torch.arange(bs, device=q.device)).view(batch, -1)
    end = lens.unsqueeze(1)  # the query sits at position end - 1
    allowed = pos < end
    if layer.window is not None:
        allowed &= pos > end - 1 - layer.window
    out = _attend_dense(q.unsqueeze(2), k, v, allowed[:, None, None, :], scale, layer)
    return out[:, :, 0]


def _prefill_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    layer: LayerAttention,
) -> torch.Tensor:
    """:func:`_prefill_torch` for a windowed / softcapped / sink layer: ``[q_len, H, D]``."""
    q_len, ctx = q.shape[0], chunk.context_len
    start = ctx - q_len
    lo = 0  # first key position read: a window skips whole blocks before it
    if chunk.context_blocks is None:
        kc, vc = k, v
    else:
        bs = cache.shape[2]
        first = max(0, start - layer.window + 1) // bs if layer.window is not None else 0
        kc, vc = _gather_blocks(cache, chunk.context_blocks[first:])
        lo = first * bs
        kc, vc = kc[: ctx - lo], vc[: ctx - lo]
    q_pos = torch.arange(start, ctx, device=q.device).unsqueeze(1)
    k_pos = torch.arange(lo, ctx, device=q.device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if layer.window is not None:
        allowed &= k_pos > q_pos - layer.window
    qh = q.transpose(0, 1).unsqueeze(0)
    kh, vh = kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0)
    out = _attend_dense(qh, kh, vh, allowed[None, None], scale, layer)
    return out[0].transpose(0, 1)
