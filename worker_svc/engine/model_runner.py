"""Loads a transformers causal LM with paged attention and runs packed forward passes."""

from __future__ import annotations

import bisect
import inspect
import itertools
import time
import types
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from worker_svc.engine import cpu_attention, cuda_graphs, triton_attention
from worker_svc.engine.arch import (
    AttentionSpec,
    UnsupportedModelError,
    architecture_name,
    attention_spec,
    check_model_class,
    check_multimodal,
)
from worker_svc.engine.attention import (
    ATTN_IMPL_NAME,
    attention_context,
    build_attention_metadata,
    every_row,
    register_paged_attention,
    row_index,
)
from worker_svc.engine.config import EngineConfig, default_dtype
from worker_svc.engine.host_copy import own, pinned_to, to_device
from worker_svc.engine.lora import LoraManager
from worker_svc.engine.merged_projections import check_merged, merge_projections
from worker_svc.engine.multimodal import is_multimodal_checkpoint, load_causal_lm, merge_mm_rows, mm_rows
from worker_svc.engine.request import Request
from worker_svc.engine.sampling import SamplingParams
from worker_svc.engine.scheduler import ScheduledRequest

__all__ = ["InFlight", "ModelInfo", "ModelOutput", "ModelRunner", "inductor_options", "runtime_guards"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about the loaded model and its KV cache."""

    model_dir: str
    max_model_len: int
    block_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    attention_backend: str
    hidden_size: int = 0
    dtype: str = "float32"
    # Sampling defaults of the model's generation_config.json (EngineConfig.generation_config).
    sampling_defaults: tuple[tuple[str, float], ...] = ()


# The generation_config.json fields a request's unset sampling fields default to, as vLLM's
# --generation-config auto takes them (max_new_tokens aside: the gateway always sets max_tokens).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(gen_cfg: Any) -> tuple[tuple[str, float], ...]:
    """The fields of ``GENERATION_DEFAULT_FIELDS`` that the model's generation config sets to other
    than transformers' defaults; ValueError naming the field when one is out of range."""
    if gen_cfg is None:
        return ()
    diff = gen_cfg.to_diff_dict()
    found = tuple((name, diff[name]) for name in GENERATION_DEFAULT_FIELDS if diff.get(name) is not None)
    try:
        SamplingParams(**dict(found)).validate()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the model's generation_config.json: {exc}") from None
    return found


@dataclass
class ModelOutput:
    """Logits of one step, in the model's dtype.

    ``sample_logits[i]`` belongs to ``sample_items[i]`` (chunks reaching the end of
    their sequence). ``prompt_logits`` holds, for chunks of requests that asked for
    prompt logprobs, the logits of every position in the chunk.
    """

    sample_items: list[ScheduledRequest]
    sample_logits: torch.Tensor
    prompt_logits: list[tuple[ScheduledRequest, torch.Tensor]] = field(default_factory=list)


@dataclass
class InFlight:
    """The sampled tokens of a step launched but not read back, left on the device, and the
    row of each sampled request in them: the next step's rows of those requests take their
    input token from there (async scheduling, `LLMEngine.step`)."""

    tokens: torch.Tensor
    rows: dict[Request, int]


# (row of the step's input ids, row of InFlight.tokens) of each input token still in flight.
LateRows = list[tuple[int, int]]


def _needs_prompt_logits(item: ScheduledRequest) -> bool:
    req = item.request
    return (
        req.sampling_params.prompt_logprobs is not None
        and not req.prompt_logprobs_sent
        and item.start < req.num_prompt_tokens - 1
    )


class ModelRunner:
    """Owns the model and the KV cache; executes one packed batch per call."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import GenerationConfig

        register_paged_attention()
        self.config = config
        self.device = torch.device(config.device)
        self.dtype_name = default_dtype(config.device) if config.dtype == "auto" else config.dtype
        self.dtype = _DTYPES[self.dtype_name]
        # Refused before loading: a model class without AttentionInterface would never
        # call the paged attention (transformers raises KeyError, or worse).
        _precheck_model_dir(config.model_dir)
        # A vision-language checkpoint loads as its language model only (no vision tower).
        model: Any = load_causal_lm(config.model_dir, ATTN_IMPL_NAME, self.dtype)
        self.model: Any = model.to(self.device).eval()
        text_cfg = self.model.config.get_text_config()
        arch = architecture_name(text_cfg)
        check_model_class(type(self.model), arch)
        self.attention: AttentionSpec = attention_spec(text_cfg, arch)
        try:
            gen_cfg: Any = GenerationConfig.from_pretrained(config.model_dir)
        except OSError:  # no generation_config.json
            gen_cfg = None
        self.info = self._model_info(text_cfg, gen_cfg)
        # Queries per program of the triton backend's one-launch prefill attention.
        group = int(text_cfg.num_attention_heads) // self.info.num_kv_heads
        self.prefill_block_q = triton_attention.prefill_block_q(group)
        # Before the KV cache takes its memory (the separate weights' memory is returned
        # first), LoRA wraps the projections (the merged parts) and the probe (which unmerges
        # a group whose projections read different inputs).
        self.merged = merge_projections(self.model) if config.merges_projections(self.device.type) else []
        if self.merged and self.device.type == "cuda":
            torch.cuda.empty_cache()
        # One block past the block manager's: where CUDA graphs' padding rows write (cuda_graphs).
        self.scratch_block = self.info.num_kv_blocks
        self.kv_caches = [
            torch.zeros(
                2,
                self.info.num_kv_blocks + 1,
                config.block_size,
                self.info.num_kv_heads,
                self.info.head_dim,
                dtype=self.dtype,
                device=self.device,
            )
            for _ in range(self.info.num_layers)
        ]
        self.supports_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.lora: LoraManager | None = None
        if config.max_loras:
            self.lora = LoraManager(
                self.model,
                config.max_loras,
                config.max_lora_rank,
                config.cpu_lora_capacity,
                static=config.compiles,
            )
        # Dynamic shapes: one graph serves every step, from one token to a full batch (the
        # token and kept-row counts are unbacked, _compiled_forward). Attention stays an
        # opaque custom op in the graph.
        self._compiled: Any = None
        if config.compiles:
            if self.dtype in (torch.bfloat16, torch.float16):
                eager_mean_reduction()
            # Only the guards that can change between steps are checked (runtime_guards).
            options: dict[str, Any] = {"guard_filter_fn": runtime_guards}
            self._compiled = torch.compile(own_forward(self.model), dynamic=True, options=options)
        self.compile_seconds = 0.0  # wall time of the steps that (re)compiled
        self.compile_failed = ""  # why the forward runs eagerly after all (stop_compiling)
        self._inductor_patch: Any = None  # inductor_options as a reusable context manager
        self._dynamo_patch: Any = None  # _DYNAMO_OPTIONS as one
        self._probe_attention()
        self.merged = check_merged(self.model, self.merged)
        self.graphs: cuda_graphs.DecodeGraphs | None = None
        # On CUDA a forward returns once its kernels are queued, and the host waits for them
        # only when the sampler reads its tokens: ``on_forward`` is called in between, once
        # per forward (the async front hands the previous step's outputs over then:
        # AsyncLLMEngine, docs/design-decisions.md, "Outputs handed over while the GPU runs").
        self.launches_async = self.device.type == "cuda"
        self.on_forward: Callable[[], None] | None = None
        self.graphs, self.graphs_note = cuda_graphs.for_runner(self)
        # oneDNN (CPU bf16/fp16 linears) builds a kernel per step token count on first use;
        # steps are padded to these sizes, warmed before ready (docs/design-decisions.md).
        self.step_sizes: tuple[int, ...] = ()
        if self.device.type == "cpu" and self.dtype != torch.float32:
            self.step_sizes = cpu_step_sizes(config.max_num_batched_tokens)

    def _model_info(self, cfg: Any, gen_cfg: Any) -> ModelInfo:
        num_layers = int(cfg.num_hidden_layers)
        num_heads = int(cfg.num_attention_heads)
        num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
        # Sliding windows are honoured per layer, so the limit is the model's own.
        model_len = self.attention.max_positions
        max_len = self.config.max_model_len or model_len
        if max_len > model_len:
            raise ValueError(f"max_model_len={max_len} exceeds the model's limit {model_len}")
        num_blocks = self.config.num_kv_blocks
        if not num_blocks:
            elem = torch.empty((), dtype=self.dtype).element_size()
            per_block = 2 * num_layers * self.config.block_size * num_kv_heads * head_dim * elem
            num_blocks = (self.config.kv_cache_memory_mb << 20) // per_block
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_mb is smaller than one KV block ({per_block} bytes)")
        return ModelInfo(
            model_dir=self.config.model_dir,
            max_model_len=max_len,
            block_size=self.config.block_size,
            vocab_size=int(cfg.vocab_size),
            eos_token_ids=_eos_ids(gen_cfg, cfg),
            num_kv_blocks=num_blocks,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            attention_backend=self._resolve_backend(),
            hidden_size=int(cfg.hidden_size),
            dtype=self.dtype_name,
            sampling_defaults=sampling_defaults(gen_cfg) if self.config.generation_config == "auto" else (),
        )

    def _resolve_backend(self) -> str:
        from worker_svc.engine.triton_attention import backend_supported

        ok = backend_supported(self.device, self.config.block_size)
        backend = self.config.attention_backend
        if backend == "triton" and not ok:
            raise ValueError("attention_backend='triton' needs CUDA, triton and a power-of-two block_size")
        native = self.device.type == "cpu" and self.dtype in cpu_attention.DecodeKernel.dtypes
        if backend == "cpu" and not (native and cpu_attention.load() is not None):
            raise ValueError(
                "attention_backend='cpu' needs device cpu, dtype float32/bfloat16 and a C compiler"
            )
        if backend == "auto":
            # Interpreted kernels on CPU are for testing only, never picked automatically.
            if ok and self.device.type == "cuda":
                return "triton"
            return "cpu" if native and cpu_attention.load() is not None else "torch"
        return backend

    def read_block(self, block_id: int) -> bytes:
        """One block's KV over all layers as bytes, layout [layer, k/v, token, head, dim]
        (``kv_transfer.KvLayout``). Safe off the engine thread for a pinned block: no
        step writes into a block some request or transfer still references."""
        stacked = torch.stack([kv[:, block_id] for kv in self.kv_caches])
        return bytes(stacked.cpu().contiguous().view(torch.uint8).numpy().data)

    def write_block(self, block_id: int, data: bytes) -> None:
        """Fill one block from bytes laid out as `read_block` returns them (engine thread)."""
        shape = (len(self.kv_caches), *self.kv_caches[0][:, block_id].shape)
        # One page-locked copy of the whole block: a copy per layer from pageable memory
        # would wait for the steps in flight each time.
        values = pinned_to(torch.frombuffer(bytearray(data), dtype=self.dtype).view(shape), self.device)
        for layer, kv in enumerate(self.kv_caches):
            kv[:, block_id].copy_(values[layer])

    def execute(self, batch: Sequence[ScheduledRequest], ahead: InFlight | None = None) -> ModelOutput:
        """Run one forward over all scheduled chunks; returns the logits that are needed.
        ``ahead``: the step in flight, whose sampled tokens are inputs of this one."""
        ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        sample_rows: list[int] = []
        sample_items: list[ScheduledRequest] = []
        prompt_spans: list[tuple[ScheduledRequest, int, int]] = []
        row0s: list[int] = []
        late: LateRows = []
        for item in batch:
            row0 = len(ids)
            row0s.append(row0)
            request = item.request
            if item.num_new_tokens == 1:  # a decode row: most rows of most steps
                if request.in_flight and item.start >= request.num_known_tokens:
                    if ahead is None:
                        raise RuntimeError(f"request {request.request_id}: its input token is in no step")
                    late.append((row0, ahead.rows[request]))
                    ids.append(0)  # replaced on the device
                else:
                    ids.append(request.token_id(item.start))
                positions.append(item.start)
            else:
                ids.extend(request.token_slice(item.start, item.end))
                positions.extend(range(item.start, item.end))
            if _needs_prompt_logits(item):
                prompt_spans.append((item, len(keep), len(keep) + item.num_new_tokens))
                keep.extend(range(row0, row0 + item.num_new_tokens))
            if item.needs_sample:
                # The last kept row is this chunk's last position when prompt logits were kept.
                if not keep or keep[-1] != row0 + item.num_new_tokens - 1:
                    keep.append(row0 + item.num_new_tokens - 1)
                sample_rows.append(len(keep) - 1)
                sample_items.append(item)
        if not keep and ids:
            # Only non-final prefill chunks: no logits are needed, but the step must still
            # run every layer to store its K/V. A compiled graph with no output row would
            # drop the attention ops as dead code (the custom op is functional; its cache
            # writes are invisible to inductor), so one row is kept and thrown away.
            keep.append(len(ids) - 1)
        late_tokens = (late, ahead.tokens) if late and ahead is not None else None
        logits = self._forward(batch, ids, positions, keep, _image_rows(batch, row0s), late_tokens)
        if len(sample_rows) != len(keep):  # else every kept row is sampled, in order: no copy
            logits_rows = logits[sample_rows]
        else:
            logits_rows = logits
        return ModelOutput(
            sample_items=sample_items,
            sample_logits=logits_rows,
            prompt_logits=[(item, logits[a:b]) for item, a, b in prompt_spans],
        )

    def _forward(
        self,
        batch: Sequence[ScheduledRequest],
        ids: list[int],
        positions: list[int],
        keep: list[int],
        image_rows: tuple[list[int], list[torch.Tensor]] = ([], []),
        late: tuple[LateRows, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        chunks = [(item.start, item.num_new_tokens, item.request.block_table) for item in batch]
        if self.graphs is not None and not image_rows[0]:
            lora = self.lora
            rows = None if lora is None else (lambda: lora.step_rows(self._lora_spans(batch, 0), full=True))
            replayed = self.graphs.run(chunks, ids, positions, keep, rows, late)
            if replayed is not None:
                self._forward_started()
                return replayed
        pad = self._padding(len(ids))
        if pad:
            chunks += self._padding_chunks(pad)
            ids, positions = [*ids, *[0] * pad], [*positions, *[0] * pad]
        return self._run(chunks, ids, positions, keep, self._lora_step(batch, pad), image_rows, late)

    def _run(
        self,
        chunks: list[tuple[int, int, list[int]]],
        ids: list[int],
        positions: list[int],
        keep: list[int],
        lora: AbstractContextManager[None],
        image_rows: tuple[list[int], list[torch.Tensor]],
        late: tuple[LateRows, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The forward of one packed step (``chunks`` as ``build_attention_metadata``'s);
        the logits of the ``keep`` rows. Its input tensors are made outside inference
        mode: a compiled graph is guarded on that."""
        meta = build_attention_metadata(
            chunks,
            self.config.block_size,
            self.kv_caches,
            self.device,
            self.info.attention_backend,
            self.attention.layer_windows,
            self.prefill_block_q,
        )
        lists: dict[str, Any] = {"ids": [ids], "positions": [positions]}
        if late is not None:
            lists["late"] = late[0]
        if not every_row(keep):
            lists["keep"] = keep
        sent = to_device(lists, self.device)
        input_ids = own(sent["ids"])
        if late is not None:
            cuda_graphs.put_late_tokens(input_ids[0], sent["late"], late[1])
        position_ids = own(sent["positions"])
        keep_t = own(sent["keep"]) if "keep" in lists else row_index(keep, self.device)
        kwargs: dict[str, Any] = {"use_cache": False}
        if self.supports_logits_to_keep:
            kwargs["logits_to_keep"] = keep_t
        with torch.inference_mode(), attention_context(meta), lora:
            if image_rows[0]:
                # Image placeholders in this step: token embeddings with the image rows replaced.
                embeds = merge_mm_rows(self.model.get_input_embeddings()(input_ids), *image_rows)
                out = self.model(inputs_embeds=embeds, position_ids=position_ids, **kwargs)
            else:
                out = self.model_forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
        self._forward_started()
        logits: torch.Tensor = out.logits[0]
        if not self.supports_logits_to_keep:
            logits = logits[keep_t]
        # In the model's dtype: the sampler's greedy fast path needs no float32 copy.
        return logits

    @staticmethod
    def start_readback(tensors: Sequence[torch.Tensor]) -> Callable[[], list[list[Any]]]:
        """Starts copying a draw's ``tensors`` to the host without waiting for them; the call
        returned waits for them and lists them."""
        if not tensors or tensors[0].device.type != "cuda":
            return lambda: [t.tolist() for t in tensors]
        hosts = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory
        copied = torch.cuda.Event()
        copied.record()

        def read() -> list[list[Any]]:
            copied.synchronize()
            return [h.tolist() for h in hosts]

        return read

    def _forward_started(self) -> None:
        if self.launches_async and self.on_forward is not None:
            self.on_forward()

    def model_forward(self, **kwargs: Any) -> Any:
        """The model's forward, compiled when the config ``compiles`` (inside attention_context)."""
        if self._compiled is not None:
            return self._compiled_forward(**kwargs)
        return self.model(**kwargs)

    def stop_compiling(self, reason: str) -> None:
        """Every later step runs the eager forward (the compiler failed on this model)."""
        self._compiled = None
        self.compile_failed = reason

    def _lora_step(self, batch: Sequence[ScheduledRequest], pad: int) -> AbstractContextManager[None]:
        """Each chunk's rows under its request's adapter, padding rows under none (nothing to
        do without LoRA)."""
        if self.lora is None:
            return nullcontext()
        return self.lora.step(self._lora_spans(batch, pad), self.device)

    @staticmethod
    def _lora_spans(batch: Sequence[ScheduledRequest], pad: int) -> list[tuple[str, int]]:
        return [(it.request.lora_name, it.num_new_tokens) for it in batch] + [("", pad)] * bool(pad)

    def _padding(self, rows: int) -> int:
        """How many padding rows take a step of ``rows`` tokens to its step size (0 past the
        largest, or where steps are not padded)."""
        i = bisect.bisect_left(self.step_sizes, rows)
        return self.step_sizes[i] - rows if i < len(self.step_sizes) else 0

    def _padding_chunks(self, rows: int) -> list[tuple[int, int, list[int]]]:
        """``rows`` padding rows, as CUDA graphs pad: one token at position 0 each, its K/V
        in the scratch block."""
        return [(0, 1, [self.scratch_block])] * rows

    def warm_step_sizes(self) -> None:
        """One forward of padding rows only at each step size: oneDNN builds its kernels
        for them now, before the worker reports ready, not on a user's request."""
        for size in self.step_sizes:
            pads = [0] * size
            self._run(self._padding_chunks(size), pads, pads, [0], self._lora_step((), size), ([], []))

    def _probe_attention(self) -> None:
        """One 1-token forward pass at load (into block 0, which no request holds yet):
        every layer must reach the paged attention exactly once, with arguments it
        honours and the sliding window the config promised -- else refuse the model."""
        arch = self.attention.architecture
        meta = build_attention_metadata(
            [(0, 1, [0])],
            self.config.block_size,
            self.kv_caches,
            self.device,
            "torch",
            self.attention.layer_windows,
        )
        meta.probe = {}
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        try:
            with torch.inference_mode(), attention_context(meta):
                self.model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)
        except RuntimeError as exc:
            raise UnsupportedModelError(arch, str(exc)) from exc
        layers = sorted(meta.probe)
        if layers != list(range(self.info.num_layers)):
            raise UnsupportedModelError(
                arch,
                f"attention of layers {layers} reached the paged attention, expected 0..{self.info.num_layers - 1}",
            )
        repeated = [i for i, calls in meta.probe.items() if calls != 1]
        if repeated:
            raise UnsupportedModelError(arch, f"layers {repeated} call attention more than once per forward")

    def _compiled_forward(self, **kwargs: Any) -> Any:
        from torch._dynamo.utils import counters
        from torch._inductor import config as inductor_config

        frames = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        # Set for our calls only (graphs compile lazily, inside them), not process-wide.
        # The patch objects are built once, not per call: they are on every decode step's path.
        if self._inductor_patch is None:
            self._inductor_patch = inductor_config.patch(inductor_options(self.device.type, self.dtype))
            self._dynamo_patch = torch._dynamo.config.patch(_DYNAMO_OPTIONS)
        # Unbacked, a count of 1 is not specialized: the step of one token (batch-1 decode)
        # runs the graph every other step runs, and the worker compiles one graph, not two
        # (docs/design-decisions.md, "The forward is compiled by default on CPU, before ready").
        for name, dim in _UNBACKED_DIMS:
            if name in kwargs:
                torch._dynamo.decorators.mark_unbacked(kwargs[name], dim)
        mask = None if self.lora is None else self.lora.step_mask
        if mask is not None:  # rows: the step's tokens; columns: every slot's, fixed
            torch._dynamo.decorators.mark_unbacked(mask, 0)
            torch._dynamo.mark_static(mask, 1)
        with self._dynamo_patch, self._inductor_patch:
            out = self._compiled(**kwargs)
        if counters["stats"]["unique_graphs"] != frames:  # this call compiled a graph
            self.compile_seconds += time.perf_counter() - start
        return out


# Python floats are constants of the traced graph: left symbolic (torch's default), one the
# compiler cannot turn into a tensor restarts the whole trace, half again of a cold compile.
_DYNAMO_OPTIONS: dict[str, Any] = {"specialize_float": True}
# The step's token count (ids and positions are [1, T]) and its sampled rows' count.
_UNBACKED_DIMS = (("input_ids", 1), ("position_ids", 1), ("logits_to_keep", 0))

# Process-wide state a compiled graph depends on (checked in C++, cheap); SHAPE_ENV holds
# the symbolic shape guards.
_GLOBAL_GUARDS = frozenset(
    {
        "GLOBAL_STATE",
        "SHAPE_ENV",
        "GRAD_MODE",
        "DEFAULT_DEVICE",
        "DETERMINISTIC_ALGORITHMS",
        "TORCH_FUNCTION_STATE",
    }
)


_FORWARD_SERIAL = itertools.count()


def own_forward(model: torch.nn.Module) -> Callable[..., Any]:
    """``model(**kwargs)`` under a code object of its own, for ``torch.compile``.

    Dynamo keys compiled graphs by code object, and :func:`runtime_guards` drops the guards
    that tell two models apart: two runners in one process (tests, benches, an engine built
    again) compiling the same class's forward would share the first one's graph -- its
    frozen weights, its vocabulary. A distinct code object per runner keeps them apart."""

    def forward(**kwargs: Any) -> Any:
        return model(**kwargs)

    code = forward.__code__.replace(co_name=f"meshserve_forward_{next(_FORWARD_SERIAL)}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)


def runtime_guards(entries: Sequence[Any]) -> list[bool]:
    """Which dynamo guards the compiled forward checks on every call (``guard_filter_fn``).

    Kept: grad mode and other global state, the symbolic shape guards, and tensor guards
    on the step's own inputs (ids, positions, kept rows: dtype, device, static sizes, so
    batch size 1 vs many still selects the right graph). Dropped: guards on the model's
    modules, parameters, buffers and config, and on module globals. The runner never
    changes the model after loading (its weights are frozen into the graph anyway), so
    those guards cannot fail, and checking them is on every batch-1 decode step's path.
    """
    keep = []
    for entry in entries:
        if entry.guard_type in _GLOBAL_GUARDS:
            keep.append(True)
        elif entry.guard_type == "TENSOR_MATCH":
            keep.append(not entry.is_global and not isinstance(entry.value, torch.nn.Parameter))
        else:
            keep.append(False)
    return keep


_EAGER_MEAN = False


class _MeanLoweringKey(CustomGraphPass):
    """A no-op post-grad pass whose uuid names how ``mean`` is lowered (FX cache key)."""

    def __call__(self, graph: torch.fx.graph.Graph) -> None:
        return None

    def uuid(self) -> str:
        return "meshserve-mean-aten" if _EAGER_MEAN else "meshserve-mean-inductor"


_MEAN_KEY = _MeanLoweringKey()


def eager_mean_reduction() -> None:
    """Make inductor call ATen's own ``mean`` kernel instead of generating the reduction
    (process-wide, once; only the engine compiles in a worker).

    RMSNorm's ``x.float().pow(2).mean(-1)`` summed in inductor's order differs from
    eager's vectorized sum in the last fp32 bit for many rows; the bf16 rounding that
    follows rarely hides it, so a greedy request can leave bf16 ``generate`` at a near-tie.
    With ATen's kernel the compiled graph sums like eager (the other kernels are already
    exact under :func:`inductor_options`; docs/design-decisions.md, "Compiled forward:
    inductor options").

    Inductor's FX graph cache does not see this change (its key covers config, not the
    lowering table), so :func:`inductor_options` carries :class:`_MeanLoweringKey`: graphs
    compiled with and without the fallback never share a cache entry.
    """
    global _EAGER_MEAN
    if _EAGER_MEAN:
        return
    from torch._inductor import decomposition, lowering

    aten = torch.ops.aten
    for op in (aten.mean.dim, aten.mean.default):
        decomposition.decompositions.pop(op, None)
        lowering.lowerings.pop(op, None)
    lowering.make_fallback(aten.mean, warn=False)
    _EAGER_MEAN = True


def inductor_options(device_type: str, dtype: torch.dtype) -> dict[str, Any]:
    """Inductor settings of the compiled forward.

    On CPU, ``freezing`` folds the weights into the graph as constants so inductor can
    prepack them for oneDNN.

    In bf16/fp16 the compiled graph must round like eager PyTorch, else greedy tokens leave
    transformers' ``generate`` at near-ties: ``emulate_precision_casts`` keeps every
    low-precision intermediate rounded as eager does (fused RMSNorm, RoPE, SiLU*mul were
    computed in float32 throughout), and ``pattern_matcher=False`` stops the post-grad
    fusions that fold SiLU or the residual add into the prepacked oneDNN linear (applied
    to its float32 accumulator, before the bf16 rounding eager does). Weight prepacking
    is a freezing pass, not a post-grad pattern: it stays, and a prepacked linear equals
    eager ``F.linear`` bit for bit here (tests/worker_engine/test_bf16_parity.py).

    On CPU, ``cpp_wrapper`` generates the graph's calling code (the sequence of kernel and
    extern-op calls) in C++ instead of Python: the same kernels, without Python's cost per
    call, for a longer compile.

    On CPU, ``cpp.enable_concat_linear`` (a freezing pass) merges the linears that read the
    same input -- q/k/v, gate/up -- into one GEMM over concatenated weights: fewer, larger
    oneDNN calls (greedy tokens unchanged: each output column keeps its own reduction).

    What each option is worth: docs/design-decisions.md, "Compiled forward: inductor options".
    """
    cpu = device_type == "cpu"
    options: dict[str, Any] = {"freezing": cpu, "cpp_wrapper": cpu, "cpp.enable_concat_linear": cpu}
    if dtype in (torch.bfloat16, torch.float16):
        options.update(emulate_precision_casts=True, pattern_matcher=False)
        options["post_grad_custom_post_pass"] = _MEAN_KEY  # see eager_mean_reduction
    return options


def cpu_step_sizes(max_tokens: int) -> tuple[int, ...]:
    """The token counts a CPU step is padded to, up to ``max_tokens`` (itself one): every
    count to 16 (small decode batches waste nothing), multiples of 16 to 256 (under 16 rows
    wasted), then 8 sizes per doubling (under 1/8 of the rows); 39 sizes for 512 tokens."""
    sizes = {*range(1, min(16, max_tokens) + 1), max_tokens}
    size, spacing = 16, 16
    while size + spacing < max_tokens:
        size += spacing
        sizes.add(size)
        if size >= 256 and size & (size - 1) == 0:
            spacing *= 2
    return tuple(sorted(sizes))


def _image_rows(batch: Sequence[ScheduledRequest], row0s: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Packed rows of this step that are image placeholders, with their embeddings."""
    if not any(item.request.mm_inputs for item in batch):
        return [], []
    return mm_rows([(r, it.start, it.end, it.request.mm_inputs) for r, it in zip(row0s, batch, strict=True)])


def _precheck_model_dir(model_dir: str) -> None:
    """UnsupportedModelError when the checkpoint's causal LM class cannot take the paged
    attention or its config asks for attention it does not implement (from config.json only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    top = AutoConfig.from_pretrained(model_dir)
    if is_multimodal_checkpoint(model_dir):
        check_multimodal(str(top.model_type), architecture_name(top))
    cfg = top.get_text_config()
    arch = architecture_name(cfg)
    try:
        found: Any = AutoModelForCausalLM._model_mapping[type(cfg)]
    except KeyError:
        raise UnsupportedModelError(
            arch, f"transformers has no causal LM class for config {type(cfg).__name__}"
        ) from None
    # A config type may map to several classes (a tuple): every candidate must qualify.
    for model_cls in found if isinstance(found, tuple) else (found,):
        check_model_class(model_cls, arch)
    attention_spec(cfg, arch)  # config-level refusals before any weight is read


def _eos_ids(gen_cfg: Any, cfg: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (gen_cfg, cfg):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            value = [value]
        for tok in value or []:
            if isinstance(tok, int) and tok not in ids:
                ids.append(tok)
    return tuple(ids)
