"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed per step.

A decode-only step (every chunk one new token, every row sampled) of ``n`` sequences runs
the graph of the smallest bucket ``>= n``: the step's token ids and positions are copied
into static buffers (the tensors the graph was captured on), with the block-table entries
that changed since the last step (the tables stay between steps, docs/design-decisions.md,
"Decode graphs keep their block tables"); the graph derives KV slots and context lengths
first. The rows past ``n`` are padding, and the first ``n`` rows of the graph's logits are
the step's. Prefill and mixed steps, steps with image rows, and
decode steps larger than the largest bucket run eagerly.

Padding rows never touch a real KV block: their slot is in the *scratch block*, one block
past those the block manager hands out (the runner allocates it), their block table
points only at it and their context length is 1. A real row's table is written up to the
blocks its context covers; later columns may hold a previous step's ids, which the decode
kernels never read (they stop at the row's context length).

Capture is a parameter (:data:`Capture`): :func:`cuda_capture` records a
``torch.cuda.CUDAGraph``; a test on CPU passes a capture that returns the function itself,
so "replay" reruns the same forward on the same static buffers. Only the decode kernels
that read block tables through a stride (``triton`` and the native ``cpu`` backend) take
graphs; the torch/sdpa backends build per-step shapes and stay eager.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from worker_svc.engine.attention import AttentionMetadata, attention_context
from worker_svc.engine.host_copy import pinned, to_device

__all__ = [
    "GRAPH_BACKENDS",
    "Capture",
    "DecodeGraphs",
    "attach",
    "bucket_sizes",
    "cuda_capture",
    "for_runner",
    "put_late_tokens",
]

log = logging.getLogger(__name__)

# Attention backends whose decode kernels take fixed-width block tables (see module docstring).
GRAPH_BACKENDS = ("triton", "cpu")

# Turns a forward over static buffers into its replay (which returns the same output tensor).
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]
# (chunk start position, new tokens, block table) of every sequence of a step.
Chunks = Sequence[tuple[int, int, Sequence[int]]]


def bucket_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs``
    (always included), so a step pads at most 7 rows."""
    small = [b for b in (1, 2, 4) if b < max_num_seqs]
    return tuple(sorted({*small, *range(8, max_num_seqs, 8), max_num_seqs}))


def cuda_capture(pool: Any = None, phases: dict[str, float] | None = None) -> Capture:
    """Capture into a ``torch.cuda.CUDAGraph`` after two warm-up runs on a side stream
    (lazy initialisation -- cuBLAS workspaces, Triton compiles -- must not happen inside
    the capture). Graphs sharing ``pool`` share memory: capture the largest first.
    ``phases`` sums the seconds of the warm-up runs and of the recordings (start-up cost)."""
    spent = phases if phases is not None else {}

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        warm = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the worker's event loop) stay legal meanwhile.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
        spent["warm_up_s"] = spent.get("warm_up_s", 0.0) + warm - start
        spent["record_s"] = spent.get("record_s", 0.0) + time.perf_counter() - warm

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class DecodeGraphs:
    """Static buffers, one captured forward per bucket, and the per-step fill and replay.

    ``forward(meta, input_ids [1, n], position_ids [1, n], lora_mask [n, width] or None,
    rows [n])`` returns the logits of all ``n`` rows (``rows``: 0..n-1, the rows to keep);
    it runs only at capture (and at every replay under a CPU test capture). A bucket's
    inputs are contiguous, as an eager step's are, so that a compiled forward's guards hold
    for every bucket and for eager steps alike: one compiled graph serves them all. With
    ``lora_width``, the step's LoRA mask (every slot's columns, worker_svc.engine.lora) is
    a static buffer too: base and adapter rows replay the same graph, padding rows under
    no adapter.
    """

    def __init__(
        self,
        forward: Callable[
            [AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor
        ],
        *,
        buckets: Sequence[int],
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        scratch_block: int,
        backend: str,
        layer_windows: Sequence[int | None],
        device: torch.device,
        lora_width: int = 0,
        lora_dtype: torch.dtype = torch.float32,
    ) -> None:
        if backend not in GRAPH_BACKENDS:
            raise ValueError(
                f"CUDA graphs need attention backend {' or '.join(GRAPH_BACKENDS)}, got {backend!r}"
            )
        self.forward = forward
        self.buckets = tuple(sorted(buckets))
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.backend = backend
        self.layer_windows = layer_windows
        self.device = device
        n, width = self.buckets[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros((n,), dtype=torch.long, device=device)  # a bucket views [1, size]
        self.positions = torch.zeros((n,), dtype=torch.long, device=device)
        self.slots = torch.empty((n,), dtype=torch.long, device=device)
        self.tables = torch.empty((n, width), dtype=torch.int32, device=device)
        self.lens = torch.empty((n,), dtype=torch.int32, device=device)
        self.lora_mask = torch.zeros((n, lora_width), dtype=lora_dtype, device=device) if lora_width else None
        # Per row: the block table whose entries the row holds, and how many (None: padding).
        self._held: list[tuple[Sequence[int] | None, int]] = [(None, 0)] * n
        self.pad(n)
        self.rows = torch.arange(n, dtype=torch.long, device=device)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.capture_s = 0.0
        self.capture_largest_s = 0.0  # of capture_s, the first bucket's (the largest)
        self.capture_phases: dict[str, float] = {}  # cuda_capture's warm-up / recording seconds
        self.replays = 0  # steps that ran a graph
        self.padded_rows = 0  # padding rows those steps computed
        self.oversize = 0  # decode-only steps larger than the largest bucket (eager)

    def pad(self, rows: int) -> None:
        """Makes the first ``rows`` rows padding: their K/V go to the scratch block only
        (position 0, block table on it: slot on it, length 1)."""
        self.positions[:rows].fill_(0)
        self.tables[:rows].fill_(self.scratch_block)
        self._held[:rows] = [(None, 0)] * rows
        self._derive(rows)

    def _derive(self, size: int) -> None:
        """Each row's KV slot and context length from its position and block table: the
        first ops of every bucket's graph, so a step copies only ids and positions in."""
        pos = self.positions[:size]
        self.lens[:size].copy_(pos + 1)
        block = self.tables[:size].gather(1, (pos // self.block_size).unsqueeze(1)).squeeze(1)
        self.slots[:size].copy_(block.long() * self.block_size + pos % self.block_size)

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a bucket: views of the static buffers."""
        return AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=self.slots[:size],
            decode_token_idx=self.rows[:size],
            decode_block_tables=self.tables[:size],
            decode_seq_lens=self.lens[:size],
            backend=self.backend,
            layer_windows=self.layer_windows,
        )

    def capture(self, capture: Capture) -> None:
        """Captures every bucket, the largest first; the buffers hold padding meanwhile, so
        the capture's own forwards write K/V only into the scratch block."""
        start = time.perf_counter()
        for size in reversed(self.buckets):
            self._replays[size] = capture(self._bucket_forward(size))
            if not self.capture_largest_s:  # the first one also initialises lazily
                self.capture_largest_s = time.perf_counter() - start
        self.capture_s = time.perf_counter() - start

    def _bucket_forward(self, size: int) -> Callable[[], torch.Tensor]:
        meta = self.metadata(size)
        ids, pos = self.input_ids[:size].view(1, size), self.positions[:size].view(1, size)
        mask = None if self.lora_mask is None else self.lora_mask[:size]
        rows = self.rows[:size]

        def forward() -> torch.Tensor:
            self._derive(size)
            return self.forward(meta, ids, pos, mask, rows)

        return forward

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows (None: more rows than the largest)."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def run(
        self,
        chunks: Chunks,
        ids: list[int],
        positions: list[int],
        keep: list[int],
        lora_rows: Callable[[], torch.Tensor] | None = None,
        late: tuple[Sequence[tuple[int, int]], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """The logits ``[n, vocab]`` of a decode-only step through its bucket's graph, or
        None when the step must run eagerly (not decode-only, or too large). ``lora_rows``
        gives the step's LoRA mask ``[n, lora_width]`` on the host (graphs with LoRA).
        ``late``: ``((row, i), ...)`` and a device tensor: row ``row``'s input id is its
        ``i``-th entry (tokens of a step still in flight)."""
        n = len(chunks)
        if n == 0 or len(ids) != n or any(q_len != 1 for _, q_len, _ in chunks) or keep != list(range(n)):
            return None
        size = self.bucket(n)
        if size is None:
            self.oversize += 1
            return None
        self._fill(size, chunks, ids, positions, late)
        if self.lora_mask is not None:
            rows = torch.zeros((size, self.lora_mask.shape[1]), dtype=self.lora_mask.dtype)
            if lora_rows is not None:
                rows[:n] = lora_rows()
            self.lora_mask[:size].copy_(pinned(rows, self.device), non_blocking=True)
        logits = self._replays[size]()
        self.replays += 1
        self.padded_rows += size - n
        return logits[:n]

    def _fill(
        self,
        size: int,
        chunks: Chunks,
        ids: list[int],
        positions: list[int],
        late: tuple[Sequence[tuple[int, int]], torch.Tensor] | None = None,
    ) -> None:
        """Copies one step into the static buffers in one host-to-device transfer, which
        does not wait for the steps queued before it: ids and positions, and of the block
        tables only the entries that changed since the rows last held them (`_table_edits`);
        rows ``n..size`` become padding; then ``late`` rows take their ids (``run``). The
        graph derives slots and lengths (`_derive`)."""
        pad = size - len(chunks)
        edits = self._table_edits(chunks, size)
        # Padding rows repeat the first token (any id in the vocabulary would do) at position 0.
        lists: dict[str, Sequence[Any]] = {
            "ids": [*ids, *[ids[0]] * pad],
            "positions": [*positions, *[0] * pad],
            "edits": edits,
        }
        if late is not None:
            lists["late"] = late[0]
        sent = to_device(lists, self.device)
        self.input_ids[:size].copy_(sent["ids"])
        self.positions[:size].copy_(sent["positions"])
        if edits:
            edit = sent["edits"].view(-1, 3)
            self.tables[edit[:, 0], edit[:, 1]] = edit[:, 2].to(self.tables.dtype)
        if late is not None:
            put_late_tokens(self.input_ids, sent["late"], late[1])

    def _table_edits(self, chunks: Chunks, size: int) -> list[int]:
        """``(row, column, block)`` triples, flattened, that make the static block tables
        hold this step's: a row still holding the same request's table gets only the blocks
        appended since (a table only grows while its request keeps its blocks; freed, it is
        a new list); another table is written whole; a row turning to padding gets the
        scratch block. Columns past a row's table keep older ids the kernels never read."""
        edits: list[int] = []
        held = self._held
        for row, (_, _, table) in enumerate(chunks):
            was, count = held[row]
            start = count if was is table else 0
            if start < len(table):
                for col in range(start, len(table)):
                    edits += (row, col, table[col])
                held[row] = (table, len(table))
        for row in range(len(chunks), size):
            if held[row][0] is not None:
                edits += (row, 0, self.scratch_block)
                held[row] = (None, 0)
        return edits

    def stats(self) -> dict[str, Any]:
        """Counters for the start-up log and the benchmarks."""
        return {
            "buckets": list(self.buckets),
            "capture_s": round(self.capture_s, 3),
            "capture_largest_s": round(self.capture_largest_s, 3),
            **{f"capture_{k}": round(v, 3) for k, v in self.capture_phases.items()},
            "replays": self.replays,
            "padded_rows": self.padded_rows,
            "oversize_steps": self.oversize,
        }


def put_late_tokens(input_ids: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor) -> None:
    """Writes a step's input tokens still in flight into ``input_ids`` on the device: for
    each ``(row, i)`` of ``index [k, 2]``, row ``row`` takes ``tokens[i]`` (the draw of the
    step in flight: async scheduling)."""
    input_ids[index[:, 0]] = tokens[index[:, 1]]


def attach(runner: Any, capture: Capture) -> DecodeGraphs:
    """Decode graphs for a :class:`~worker_svc.engine.model_runner.ModelRunner`, captured with
    ``capture``, buckets up to its ``max_num_seqs``; installed as ``runner.graphs``."""
    info, config = runner.info, runner.config
    lora = getattr(runner, "lora", None)

    def forward(
        meta: AttentionMetadata,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        masked = nullcontext() if lora is None else lora.masked(mask)
        # Every row's logits kept as an eager step keeps them (logits_to_keep where the model
        # takes it): the same arguments, so a compiled forward is the eager steps' graph.
        keep = {"logits_to_keep": rows} if runner.supports_logits_to_keep else {}
        with torch.inference_mode(), attention_context(meta), masked:
            out = runner.model_forward(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **keep
            )
        logits: torch.Tensor = out.logits[0]
        return logits

    graphs = DecodeGraphs(
        forward,
        buckets=bucket_sizes(config.max_num_seqs),
        kv_caches=runner.kv_caches,
        block_size=info.block_size,
        max_model_len=info.max_model_len,
        scratch_block=runner.scratch_block,
        backend=info.attention_backend,
        layer_windows=runner.attention.layer_windows,
        device=runner.device,
        lora_width=0 if lora is None else lora.max_loras * lora.max_rank,
        lora_dtype=runner.dtype,
    )
    graphs.capture(capture)
    runner.graphs = graphs
    return graphs


def for_runner(runner: Any) -> tuple[DecodeGraphs | None, str]:
    """The runner's decode graphs when its config asks for them and they can run here
    (CUDA, a graph backend); else None and why. A failed capture is logged and leaves the
    runner eager."""
    if not runner.config.cuda_graphs:
        return None, "cuda_graphs off"
    if runner.device.type != "cuda":
        return None, f"CUDA graphs need CUDA (device {runner.device.type})"
    backend = runner.info.attention_backend
    if backend not in GRAPH_BACKENDS:
        return None, f"attention backend {backend} builds per-step shapes (graphs need {GRAPH_BACKENDS})"
    phases: dict[str, float] = {}
    graphs, note = capture_graphs(runner, cuda_capture(torch.cuda.graph_pool_handle(), phases))
    if graphs is not None:
        graphs.capture_phases = phases
    return graphs, note


def capture_graphs(runner: Any, capture: Capture) -> tuple[DecodeGraphs | None, str]:
    """The runner's decode graphs captured with ``capture``, or None and why. When the
    compiler fails on the model inside the capture, the eager forward is captured instead:
    graphs of it are still worth far more than none (the start-up line then says compiled
    no, and why). Any other capture failure leaves the runner eager."""
    try:
        graphs = attach(runner, capture)
    except Exception as exc:
        if runner.compile_failed or not runner.config.compiles:
            log.warning("CUDA graph capture failed, decode runs eagerly: %r", exc)
            runner.graphs = None
            return None, f"capture failed: {exc!r}"
        log.warning("compiling the forward failed during CUDA graph capture, capturing it eagerly: %r", exc)
        runner.stop_compiling(f"compile failed: {type(exc).__name__}")
        return capture_graphs(runner, capture)
    log.info("CUDA graphs: %d buckets captured in %.1f s", len(graphs.buckets), graphs.capture_s)
    return graphs, ""
