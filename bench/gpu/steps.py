"""The steps of the GPU kit (bench.gpu.kit): each fills ``ctx.record`` with its figures
and raises :class:`~bench.gpu.kit.Skip` for what cannot run on this device."""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import math
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench.engine_bench import (
    Workload,
    bench_hf_naive,
    bench_mesh,
    engine_generate_fn,
    load_hf_model,
    make_workload,
    run_generate_workload,
    warm_up,
)
from bench.gpu.context import Profile, Skip, StepContext
from worker_svc.engine import AsyncLLMEngine, EngineConfig, LLMEngine, RequestSpec, SamplingParams

BLOCK_SIZE = 16
ARCHS = ("Llama", "Qwen3", "Gemma 3")  # devtools.arch_matrix names: plain, QK norm, sliding window
NEW_TOKENS = 12
# Prompt lengths of the correctness requests, run together: 7 decode rows pad to a bucket of
# 8, and the longest outgrows Gemma 3's window of 8 and spans several KV blocks.
CORRECTNESS_PROMPTS = (3, 9, 17, 33, 40, 5, 26)


def _cuda(ctx: StepContext) -> bool:
    return ctx.profile.device.startswith("cuda")


# ------------------------------------------------------------------ build
def build(ctx: StepContext) -> None:
    """The bench model (random weights) and a word-level tokenizer of its vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    p = ctx.profile
    cfg = LlamaConfig(
        vocab_size=p.vocab,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        max_position_embeddings=p.max_model_len,
        rope_theta=500000.0,
        tie_word_embeddings=True,  # as Llama-3.2-1B
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    start = time.monotonic()
    torch.manual_seed(0)
    with torch.device(p.device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, p.dtype))
    model.save_pretrained(ctx.model_dir)
    _save_tokenizer(ctx.model_dir, p.vocab)
    ctx.record("parameters", sum(t.numel() for t in model.parameters()))
    ctx.record("weight_bytes", sum(t.numel() * t.element_size() for t in model.parameters()))
    ctx.record("build_s", round(time.monotonic() - start, 2))


def _save_tokenizer(model_dir: str, vocab: int) -> None:
    """One word per id ("t0", "t1", ...): the mesh's tokenizer and detokenizer need one that
    covers the model's vocabulary; the bench sends token ids, so its text is never read."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", pad_token="t0", bos_token="t1", eos_token="t2"
    )
    fast.save_pretrained(model_dir)


# ------------------------------------------------------------ correctness
def _greedy_reference(model: Any, prompt: list[int], device: str) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _engine_greedy(
    config: EngineConfig, prompts: list[list[int]], adapters: list[str] | None = None
) -> tuple[list[list[int]], dict[str, Any]]:
    """All prompts at once through a fresh engine (prompt i under LoRA adapter
    ``adapters[i]``, "" for none): their tokens, and its CUDA graph counters."""
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(RequestSpec(str(i), prompt, params, lora_name=adapters[i] if adapters else ""))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[str(i)] for i in range(len(prompts))], _graph_stats(engine)


def _graph_stats(engine: LLMEngine) -> dict[str, Any]:
    """The CUDA graph counters of the engine's runner, or why it has none; and whether its
    forward ran compiled (a compiler failure falls back to the eager forward: why)."""
    runner = engine.runner
    compiled = {"compiled": engine.config.compiles and not runner.compile_failed}
    if runner.compile_failed:
        compiled["compile_failed"] = runner.compile_failed
    if runner.graphs is None:
        return {"disabled": runner.graphs_note, "engine_steps": engine.num_steps, **compiled}
    # replays / engine_steps: the decode-only share
    return {**runner.graphs.stats(), "engine_steps": engine.num_steps, **compiled}


def _arch_reference(ctx: StepContext, name: str) -> tuple[str, list[list[int]], list[list[int]]]:
    """A tiny random float32 model of one devtools.arch_matrix case saved in the work
    directory, the correctness prompts and transformers' greedy tokens for them."""
    from transformers import AutoModelForCausalLM

    from devtools.arch_matrix import CASES, build_config

    device = ctx.profile.device
    case = next(c for c in CASES if c.name == name)
    path = ctx.work / "arch" / name.replace(" ", "_")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config(case), dtype=torch.float32).save_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    ref = ref.to(device).eval()
    gen = torch.Generator().manual_seed(1)
    vocab = int(ref.config.vocab_size)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in CORRECTNESS_PROMPTS]
    return str(path), prompts, [_greedy_reference(ref, p, device) for p in prompts]


def _arch_config(ctx: StepContext, path: str, graphs: bool) -> EngineConfig:
    """Graphs on: the CUDA default (compiled inside them); off: plain eager."""
    cuda = _cuda(ctx)
    return EngineConfig(
        model_dir=path, block_size=BLOCK_SIZE, num_kv_blocks=64, dtype="float32", device=ctx.profile.device,
        attention_backend="triton" if cuda else "auto", max_num_batched_tokens=64, cuda_graphs=graphs,
        compile_model=graphs and cuda,
    )  # fmt: skip


def _parity(config: EngineConfig, prompts: list[list[int]], expected: list[list[int]]) -> dict[str, Any]:
    got, stats = _engine_greedy(config, prompts)
    return {
        "match": got == expected,
        "matching_requests": sum(map(list.__eq__, got, expected)),
        "cuda_graphs": stats,
    }


def correctness(ctx: StepContext) -> None:
    """Engine greedy tokens == transformers ``generate`` per architecture: plain eager, and
    the CUDA default (the compiled forward in CUDA graphs)."""
    results: dict[str, Any] = {}
    for name in ARCHS:
        path, prompts, expected = _arch_reference(ctx, name)
        case_out: dict[str, Any] = {}
        for graphs in (False, True):
            label = "graphs" if graphs else "eager"
            if graphs and not _cuda(ctx):
                case_out[label] = {"skipped": "CUDA graphs need CUDA"}
                continue
            case_out[label] = _parity(_arch_config(ctx, path, graphs), prompts, expected)
        results[name] = case_out
        ctx.record("archs", results)
    ran = [v["match"] for case in results.values() for v in case.values() if "match" in v]
    ctx.record("all_match", bool(ran) and all(ran))
    ctx.record("requests_per_case", len(CORRECTNESS_PROMPTS))


# ---------------------------------------------------------------- roofline
def roofline(ctx: StepContext) -> None:
    """Copy bandwidth (read + write bytes per second) and the decode step's floor."""
    mb = ctx.profile.copy_mb
    src = torch.empty(mb << 20, dtype=torch.uint8, device=ctx.profile.device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start = time.perf_counter()
        dst.copy_(src)
        if _cuda(ctx):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    best = min(times[2:])  # after two warm-ups
    bandwidth = 2 * src.numel() / best
    weight_bytes = sum(f.stat().st_size for f in Path(ctx.model_dir).glob("*.safetensors"))
    if not weight_bytes:
        raise RuntimeError("no bench model: the build step did not run")
    ctx.record("copy_bytes", src.numel())
    ctx.record("copy_read_write_gb_per_s", bandwidth / 1e9)
    ctx.record("weight_bytes", weight_bytes)
    ctx.record("decode_floor_ms", weight_bytes / bandwidth * 1000)


# --------------------------------------------------------- decode_attention
def decode_attention(ctx: StepContext) -> None:
    """The paged decode kernel alone, one layer of the bench model's shape, every row's
    context the workload's full length: GPU microseconds per call at each concurrency,
    unsplit (one program per sequence and KV head) and split as the engine splits it
    (``triton_attention.split_count``), 50 calls replayed from a CUDA graph (launching from
    Python would be timed instead at small sizes); the K/V bytes read per second, and the
    largest difference from a float32 torch reference."""
    if not _cuda(ctx):
        raise Skip("the Triton kernel runs natively on CUDA only")
    p = ctx.profile
    rows: dict[str, Any] = {}
    for c in p.concurrencies:
        rows[str(c)] = _decode_attention_row(p, c)
        ctx.record("rows", rows)


def _decode_attention_row(p: Profile, c: int) -> dict[str, Any]:
    from worker_svc.engine import triton_attention

    dev, dtype, head_dim = torch.device(p.device), getattr(torch, p.dtype), p.hidden // p.heads
    blocks = -(-p.max_model_len // BLOCK_SIZE)  # a CUDA graph's block-table width
    cache = torch.randn(2, c * blocks, BLOCK_SIZE, p.kv_heads, head_dim, device=dev, dtype=dtype)
    tables = torch.arange(c * blocks, device=dev, dtype=torch.int32).view(c, blocks)
    context = p.prompt_len + p.output_len
    lens = torch.full((c,), context, device=dev, dtype=torch.int32)
    q = torch.randn(c, p.heads, head_dim, device=dev, dtype=dtype)
    auto = triton_attention.split_count(c * p.kv_heads, blocks, BLOCK_SIZE, dev)
    row: dict[str, Any] = {"splits": auto}
    outs = {}
    for label, splits in (("unsplit", 1), ("split", auto)):
        call = partial(
            triton_attention.paged_decode_attention, q, cache, tables, lens, head_dim**-0.5, num_splits=splits
        )
        outs[label] = call()
        row[f"{label}_us"] = _graphed_us(call, 50)
    kv_bytes = 2 * c * context * p.kv_heads * head_dim * cache.element_size()
    row["kv_gb_per_s"] = round(kv_bytes / min(row["split_us"], row["unsplit_us"]) / 1e3, 1)
    row["max_abs_diff"] = float((outs["split"].float() - outs["unsplit"].float()).abs().max())
    row["max_abs_diff_vs_torch"] = float(
        (outs["split"].float() - _torch_decode(q, cache, context)).abs().max()
    )
    engine_split = partial(triton_attention.paged_decode_attention, q, cache, tables, lens, head_dim**-0.5)
    row["keys_per_tile_us"] = _tile_variants_us(engine_split)
    return row


# ------------------------------------------------------- prefill_attention
def prefill_attention(ctx: StepContext) -> None:
    """One layer's attention of an eager step on the triton backend (store K/V, the decode
    kernel for decode rows, the prompt chunks: worker_svc.engine.attention), its prompt
    chunks attended one SDPA call per chunk (the torch backends' path, the triton one's
    before) against the one launch for all (triton_attention.paged_prefill_attention), at
    the kit's shapes: the c=256 row's prefill step (prompts of the workload's length filling
    the token budget), chunks continuing cached context, and a mixed step (decodes of the
    mesh's concurrency beside two prompts). Microseconds per call launched from Python (an
    eager step's cost, host and GPU), and the largest difference between the two outputs."""
    if not _cuda(ctx):
        raise Skip("the Triton kernel runs natively on CUDA only")
    p = ctx.profile
    prompts = p.max_batch_tokens // p.prompt_len
    half = p.max_model_len // 2
    cases = {
        "fresh": [(0, p.prompt_len)] * prompts,
        "continued": [(half, half)] * (p.max_batch_tokens // half),
        "mixed": [(p.prompt_len, 1)] * (p.mesh_concurrency - 2) + [(0, p.prompt_len)] * 2,
    }
    rows: dict[str, Any] = {}
    for name, chunks in cases.items():
        rows[name] = _prefill_attention_row(p, chunks)
        ctx.record("rows", rows)


def _prefill_attention_row(
    p: Profile, chunks: list[tuple[int, int]], timer: Callable[[Callable[[], Any], int], float] | None = None
) -> dict[str, Any]:
    from worker_svc.engine import attention, triton_attention

    dev, dtype, head_dim = torch.device(p.device), getattr(torch, p.dtype), p.hidden // p.heads
    width = -(-p.max_model_len // BLOCK_SIZE)
    cache = torch.randn(2, len(chunks) * width, BLOCK_SIZE, p.kv_heads, head_dim, device=dev, dtype=dtype)
    tables = torch.arange(len(chunks) * width).view(len(chunks), width).tolist()
    tokens = sum(n for _, n in chunks)
    q = torch.randn(1, p.heads, tokens, head_dim, device=dev, dtype=dtype)
    k, v = (torch.randn(1, p.kv_heads, tokens, head_dim, device=dev, dtype=dtype) for _ in range(2))
    packed = [(c, n, tables[i]) for i, (c, n) in enumerate(chunks)]
    metas = {
        bq: attention.build_attention_metadata(packed, BLOCK_SIZE, [cache], dev, "triton", (), bq)
        for bq in triton_attention.PREFILL_WARPS
    }
    per_chunk = replace(metas[16], prefill_batch=None)
    scale = head_dim**-0.5

    def attend(meta: attention.AttentionMetadata) -> torch.Tensor:
        return attention._attend(meta, 0, q, k, v, scale)[0]

    want = attend(per_chunk).float()
    diff = max(float((attend(m).float() - want).abs().max()) for m in metas.values())
    timer = timer or _cuda_us
    by_block_q = {bq: timer(partial(attend, m), 20) for bq, m in metas.items()}
    return {
        "sequences": len(chunks),
        "tokens": tokens,
        "per_chunk_us": timer(partial(attend, per_chunk), 20),
        "one_launch_us": min(by_block_q.values()),
        "one_launch_us_by_block_q": by_block_q,
        "engine_block_q": triton_attention.prefill_block_q(p.heads // p.kv_heads),
        "max_abs_diff": diff,
    }


# ----------------------------------------------------------- top_p_sampler
def top_p_sampler(ctx: StepContext) -> None:
    """The sampler alone on a batch of top-p rows (``TOP_P_SAMPLING``, the bench model's
    vocabulary, peaked logits whose nuclei lie within the best candidates: the candidates'
    best case) at each host concurrency, by each of ``TOP_P_PATHS``: GPU microseconds per
    call launched from Python (the candidates' check leaves the GPU idle while the host
    waits for it); rows at a temperature alone by the draw kernel and by torch's ops; and
    the rows whose device-found nucleus differs from the sort's."""
    if not _cuda(ctx):
        raise Skip("the device's nucleus search runs natively on CUDA only")
    p = ctx.profile
    rows: dict[str, Any] = {}
    for c in p.host_concurrencies:
        rows[str(c)] = _top_p_sampler_row(p.vocab, c, torch.device(p.device))
        ctx.record("rows", rows)


def _top_p_sampler_row(
    vocab: int, c: int, dev: torch.device, timer: Callable[[Callable[[], Any], int], float] | None = None
) -> dict[str, Any]:
    from worker_svc.engine import triton_sampling
    from worker_svc.engine.request import Request
    from worker_svc.engine.sampling import Sampler, _top_k_top_p

    logits = (torch.randn(c, vocab, generator=torch.Generator().manual_seed(c)) * 3.0).to(dev)
    rows = [Request(f"top-p-{i}", [], SamplingParams(**TOP_P_SAMPLING)) for i in range(c)]  # type: ignore[arg-type]
    sampler, timer = Sampler(vocab, []), timer or _cuda_us
    out: dict[str, Any] = {}
    for label in TOP_P_PATHS:
        with top_p_path(label):
            out[f"{label}_us"] = timer(lambda: sampler.launch(logits, rows).tensors(), 20)
    # Rows at a temperature alone, from the model's bf16 logits: the draw kernel against
    # torch's, and the rows where the two draw other tokens from the same uniforms.
    plain = [Request(f"plain-{i}", [], SamplingParams(temperature=0.6)) for i in range(c)]
    bf16 = logits.bfloat16()
    tokens = {}
    for label in ("kernel", "torch"):
        with top_p_path("device" if label == "kernel" else "candidates"):
            out[f"plain_{label}_us"] = timer(lambda: sampler.launch(bf16, plain).tensors(), 20)
            torch.manual_seed(c)
            tokens[label] = sampler.launch(bf16, plain).tokens
    out["plain_draws_differing_from_torch"] = int((tokens["kernel"] != tokens["torch"]).sum())
    scaled = logits / TOP_P_SAMPLING["temperature"]
    top_p = [TOP_P_SAMPLING["top_p"]] * c
    found = scaled >= triton_sampling.nucleus_thresholds(scaled, torch.tensor(top_p, device=dev)).unsqueeze(1)
    by_sort = _top_k_top_p(scaled, [vocab] * c, top_p) > -math.inf
    out["rows_differing_from_sort"] = int((found != by_sort).any(dim=1).sum())
    drawn = sampler.launch(logits, rows).tokens  # the default: nucleus and draw in the kernel
    out["draws_outside_nucleus"] = int((~by_sort.gather(1, drawn.unsqueeze(1))).sum())
    return out


# ------------------------------------------------------------- skinny_gemm
def skinny_gemm(ctx: StepContext) -> None:
    """The bench model's decode projections at 1 and 8 rows: cuBLAS (``F.linear``) against
    the Triton experiment (bench/gpu/skinny_gemm.py) in each of its configurations, GPU
    microseconds per call replayed from CUDA graphs, the weight's bytes read per second and
    the largest difference from cuBLAS; and, by cuBLAS, q/k/v and gate/up merged into one
    weight each (what merging the projections at load would give)."""
    if not _cuda(ctx):
        raise Skip("the Triton kernel runs natively on CUDA only")
    p = ctx.profile
    kv = p.kv_heads * (p.hidden // p.heads)
    shapes = {
        "q_or_o": (p.hidden, p.hidden),
        "k_or_v": (kv, p.hidden),
        "gate_or_up": (p.intermediate, p.hidden),
        "down": (p.hidden, p.intermediate),
        "lm_head": (p.vocab, p.hidden),
        "qkv_merged": (p.hidden + 2 * kv, p.hidden),
        "gate_up_merged": (2 * p.intermediate, p.hidden),
    }
    out: dict[str, Any] = {}
    for rows in (1, 8):
        for name, (n, k) in shapes.items():
            out.setdefault(f"rows_{rows}", {})[name] = _skinny_row(
                p, rows, n, k, triton=not name.endswith("merged")
            )
            ctx.record("shapes", out)


def _skinny_row(p: Profile, rows: int, n: int, k: int, triton: bool) -> dict[str, Any]:
    from bench.gpu.skinny_gemm import CONFIGS, skinny_linear

    dev, dtype = torch.device(p.device), getattr(torch, p.dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
    x = torch.randn(rows, k, device=dev, dtype=dtype)
    row: dict[str, Any] = {"cublas_us": _graphed_us(partial(torch.nn.functional.linear, x, w), 20)}
    if triton:
        ref = torch.nn.functional.linear(x, w).float()
        timed = {c: _graphed_us(partial(skinny_linear, x, w, c), 20) for c in CONFIGS}
        best = min(timed, key=lambda c: timed[c])
        row.update(triton_us={str(c): us for c, us in timed.items()}, best=str(best), best_us=timed[best])
        row["max_abs_diff"] = float((skinny_linear(x, w, best).float() - ref).abs().max())
    row["cublas_gb_per_s"] = round(n * k * w.element_size() / row["cublas_us"] / 1e3, 1)
    return row


def _tile_variants_us(call: Callable[[], Any]) -> dict[int, float]:
    """``call`` (the engine's splits) timed with other tiles of keys than the kernel's."""
    from worker_svc.engine import triton_attention

    default, out = triton_attention.KEYS_PER_TILE, {}
    try:
        for keys in (32, 128):
            triton_attention.KEYS_PER_TILE = keys
            out[keys] = _graphed_us(call, 50)
    finally:
        triton_attention.KEYS_PER_TILE = default
    return out


def _torch_decode(q: torch.Tensor, cache: torch.Tensor, context: int) -> torch.Tensor:
    """Float32 reference of the kit's decode rows: sequence i's keys are its blocks in order."""
    c, heads, head_dim = q.shape
    kv = cache.float().view(2, c, -1, cache.shape[-2], head_dim)[:, :, :context]  # [2, c, T, Hkv, D]
    k, v = (t.repeat_interleave(heads // cache.shape[-2], dim=2) for t in kv)  # [c, T, H, D]
    scores = torch.einsum("chd,cthd->cht", q.float(), k) * head_dim**-0.5
    return torch.einsum("cht,cthd->chd", scores.softmax(-1), v)


def _graphed_us(fn: Callable[[], Any], calls: int) -> float:
    """GPU microseconds per call of ``fn``: ``calls`` calls captured in a CUDA graph, the
    graph replayed three times (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return round(_cuda_us(graph.replay, 3) / calls, 2)


def _cuda_us(fn: Callable[[], Any], calls: int) -> float:
    """Mean GPU microseconds per call of ``fn`` (CUDA events, after two warm-up calls)."""
    fn()
    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(begin.elapsed_time(end) * 1000 / calls, 2)


# ------------------------------------------------------------------ engine
def _engine_config(ctx: StepContext, cuda_graphs: bool) -> EngineConfig:
    p = ctx.profile
    return EngineConfig(
        model_dir=ctx.model_dir,
        block_size=BLOCK_SIZE,
        kv_cache_memory_mb=p.kv_cache_mb,
        max_num_seqs=max(p.concurrencies),
        max_num_batched_tokens=p.max_batch_tokens,
        max_model_len=p.max_model_len,
        dtype=p.dtype,
        device=p.device,
        cuda_graphs=cuda_graphs,
        # With graphs, the CUDA default: the forward compiled inside them. Without, plain
        # eager (the baseline), as on the CPU dry run, which cannot afford the compiles.
        compile_model=cuda_graphs and _cuda(ctx),
    )


def _workload(ctx: StepContext, num_requests: int, seed: int = 0) -> Workload:
    p = ctx.profile
    return make_workload(ctx.model_dir, num_requests, p.prompt_len, p.output_len, seed)


class _StepClock:
    """Wall time of each of an engine's steps, by kind: a decode step replayed from a CUDA
    graph, or an eager one (prefill chunks, mixed steps, or no graphs at all). A replayed
    step is also cut in three at its graph's ``run`` (``phases``): before it (scheduling,
    input preparation), within it (filling the graph's inputs, launching the replay), and
    after it (the sampler waiting for the GPU, then the step's outputs)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.inner = engine, engine.step
        self.ms: dict[str, list[float]] = {"graph": [], "eager": []}
        self.phases: list[tuple[float, float, float]] = []  # seconds before, in and after run
        self._marks: list[float] = []
        engine.step = self.step  # type: ignore[method-assign]
        self.gpu = _GpuSpans(engine) if engine.runner.device.type == "cuda" else None
        graphs = engine.runner.graphs
        if graphs is not None:
            inner_run = graphs.run

            def run(*args: Any, **kwargs: Any) -> Any:
                self._marks.append(time.perf_counter())
                out = inner_run(*args, **kwargs)
                self._marks.append(time.perf_counter())
                return out

            graphs.run = run  # type: ignore[method-assign]

    def step(self) -> Any:
        graphs, steps = self.engine.runner.graphs, self.engine.num_steps
        replays = graphs.replays if graphs is not None else 0
        self._marks = []
        start = time.perf_counter()
        out = self.inner()
        end = time.perf_counter()
        if self.engine.num_steps != steps:  # a step that ran a forward
            replayed = graphs is not None and graphs.replays != replays
            self.ms["graph" if replayed else "eager"].append((end - start) * 1000)
            if replayed and len(self._marks) == 2:
                entered, returned = self._marks
                self.phases.append((entered - start, returned - entered, end - returned))
        return out

    def take(self) -> dict[str, Any]:
        """Steps, their total and median milliseconds per kind since the last take, and the
        median milliseconds of each phase of the replayed steps."""
        out: dict[str, Any] = {
            kind: {
                "steps": len(ms),
                "total_ms": round(sum(ms), 1),
                "p50_ms": round(statistics.median_high(ms), 3),
            }
            for kind, ms in self.ms.items()
            if ms
        }
        if self.phases:
            names = ("before_run", "run", "after_run")
            out["graph_phases_p50_ms"] = {
                name: round(statistics.median_high([p[i] * 1000 for p in self.phases]), 3)
                for i, name in enumerate(names)
            }
        if self.gpu is not None and (spans := self.gpu.take()):
            out["gpu"] = gpu_idle(spans)
        self.ms = {kind: [] for kind in self.ms}
        self.phases = []
        return out


class _GpuSpans:
    """Each launched step's span on the GPU: CUDA events recorded on the stream before its
    forward is launched and after its draw and read-back are queued, with whether it
    replayed a graph."""

    def __init__(self, engine: LLMEngine) -> None:
        self.events: list[tuple[Any, Any, bool]] = []
        inner, graphs = engine._launch, engine.runner.graphs

        def launch(*args: Any, **kwargs: Any) -> Any:
            replays = graphs.replays if graphs is not None else 0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(*args, **kwargs)
            end.record()
            self.events.append((start, end, graphs is not None and graphs.replays != replays))
            return out

        engine._launch = launch  # type: ignore[method-assign]

    def take(self) -> list[tuple[float, float, str]]:
        """``(start ms, end ms, "graph" | "eager")`` of the steps since the last take, from
        the first one's start (waits for the GPU to reach the last)."""
        events, self.events = self.events, []
        if not events:
            return []
        events[-1][1].synchronize()
        first = events[0][0]
        kind = {True: "graph", False: "eager"}
        return [(first.elapsed_time(a), first.elapsed_time(b), kind[g]) for a, b, g in events]


def gpu_idle(spans: list[tuple[float, float, str]]) -> dict[str, Any]:
    """The GPU's busy and idle milliseconds over steps' spans (start, end, kind) in launch
    order: idle is the time between a step's end and the next one's start (the GPU had
    nothing queued, waiting for the host), totalled by the kind of the step that waited."""
    busy = sum(end - start for start, end, _ in spans)
    gaps: dict[str, list[float]] = {"graph": [], "eager": []}
    for (_, end, _), (start, _, kind) in itertools.pairwise(spans):
        gaps[kind].append(max(0.0, start - end))
    idle = [g for kind in gaps.values() for g in kind]
    return {
        "busy_ms": round(busy, 1),
        "idle_ms": round(sum(idle), 1),
        "idle_before_ms": {kind: round(sum(g), 1) for kind, g in gaps.items()},
        "idle_p90_ms": round(statistics.quantiles(idle, n=10)[-1], 3) if len(idle) > 1 else 0.0,
    }


def _engine_rows(ctx: StepContext, cuda_graphs: bool) -> None:
    p = ctx.profile
    start = time.monotonic()

    async def run(engine: AsyncLLMEngine) -> None:
        engine.start()
        ctx.record("warm_up", await warm_up(engine, _workload(ctx, 5, seed=99)))
        clock = _StepClock(engine.engine)
        ctx.record("load_s", round(time.monotonic() - start, 2))
        ctx.record("model_info", asdict(engine.model_info))
        ctx.record("cuda_graphs", _graph_stats(engine.engine))  # updated at the end
        rows: list[dict[str, Any]] = []
        for c in p.concurrencies:
            if ctx.left_s() < 10:
                ctx.record("cut_short", f"time box reached before c={c}")
                break
            workload = _workload(ctx, p.num_requests(c), seed=c)
            row, timings = await run_generate_workload(
                engine_generate_fn(engine, f"c{c}"), workload, c, "meshserve"
            )
            rows.append({**asdict(row), "steps": clock.take()})
            ctx.record("rows", rows)
            if c == 1:  # greedy tokens, compared with the other steps' in the summary
                ctx.record("c1_tokens", [t.tokens for t in timings])
        await _sync_scheduling_row(ctx, engine, clock)
        await _top_p_rows(ctx, engine, clock)
        ctx.record("cuda_graphs", _graph_stats(engine.engine))
        await engine.shutdown()
        _largest_replay_kernels(ctx, engine.engine)
        _prefill_step_kernels(ctx, engine.engine)
        _sync_points(ctx, engine.engine)

    asyncio.run(run(AsyncLLMEngine(_engine_config(ctx, cuda_graphs))))
    gc.collect()


async def _sync_scheduling_row(ctx: StepContext, engine: AsyncLLMEngine, clock: _StepClock) -> None:
    """The largest concurrency again with async scheduling off: each step read back before
    the next is scheduled, its outputs handed over once the next forward is launched (the
    design decisions "Async scheduling" and "Outputs handed over while the GPU runs"): what
    scheduling ahead is worth on this GPU."""
    inner, c = engine.engine, max(ctx.profile.concurrencies)
    if not inner.runs_ahead or ctx.left_s() < 20:
        return
    inner.runs_ahead = False  # between workloads: no step is in flight
    try:
        workload = _workload(ctx, ctx.profile.num_requests(c), seed=c)
        row, _ = await run_generate_workload(
            engine_generate_fn(engine, f"sync-c{c}"), workload, c, "meshserve"
        )
        ctx.record("row_sync_scheduling", {**asdict(row), "steps": clock.take()})
    finally:
        inner.runs_ahead = True


# Sampling as Llama 3's generation_config.json sets it: every request takes the top-p path.
TOP_P_SAMPLING = {"temperature": 0.6, "top_p": 0.9}
# The sampler's ways to a top-p batch's nuclei: searched on the device (the CUDA default,
# triton_sampling), from the best candidates after a check read back to the host, by a sort.
TOP_P_PATHS = ("device", "candidates", "sort")


def top_p_path(label: str) -> ExitStack:
    """The sampler held to one of ``TOP_P_PATHS`` while the returned context is open."""
    from worker_svc.engine import sampling

    stack = ExitStack()
    if label != "device":
        stack.enter_context(mock.patch.object(sampling.triton_sampling, "serves", lambda *_: False))
    if label == "sort":
        stack.enter_context(mock.patch.object(sampling, "_nucleus_candidates", lambda *_: None))
    return stack


async def _top_p_rows(ctx: StepContext, engine: AsyncLLMEngine, clock: _StepClock) -> None:
    """The mesh's concurrency with top-p sampling, by each of the sampler's top-p paths
    (``TOP_P_PATHS``): what the candidates' synchronising check costs scheduling ahead,
    and what the device's search or a sort cost instead."""
    if not engine.engine.runs_ahead or engine.engine.runner.graphs is None:  # the CUDA default only
        return
    c = ctx.profile.mesh_concurrency
    rows: dict[str, Any] = {}
    for label in TOP_P_PATHS:
        if ctx.left_s() < 20:
            break
        with top_p_path(label):
            workload = _workload(ctx, ctx.profile.num_requests(c), seed=c)
            generate = engine_generate_fn(engine, f"top-p-{label}", sampling=TOP_P_SAMPLING)
            row, _ = await run_generate_workload(generate, workload, c, "meshserve")
        rows[label] = {**asdict(row), "steps": clock.take()}
        ctx.record("top_p_rows", rows)


def _largest_replay_kernels(ctx: StepContext, engine: LLMEngine) -> None:
    """The largest bucket's graph replayed once under the profiler, its buffers as the last
    step that used it left them (rows at the workload's context lengths): the kernels of a
    full decode step. The engine is done: the K/V the replay writes is never read again."""
    graphs = engine.runner.graphs
    if graphs is None or not _cuda(ctx):
        return
    try:
        ctx.record("largest_replay_kernels", _kernel_profile(graphs._replays[graphs.buckets[-1]]))
    except Exception as exc:  # the profiler's event API moves between torch versions
        ctx.record("largest_replay_kernels", {"error": repr(exc)})


def _prefill_step_kernels(ctx: StepContext, engine: LLMEngine) -> None:
    """One step of whole prompts filling the step's token budget, under the profiler: where
    a prefill step's time goes (its GEMMs, the per-prompt attention, the rest). Each run
    takes fresh prompts (no prefix hits) and reads its step back before the next."""
    if not _cuda(ctx):
        return
    p, runs = ctx.profile, iter(range(2))
    count = max(1, p.max_batch_tokens // p.prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def one_step() -> None:
        run = next(runs)
        for i, prompt in enumerate(_workload(ctx, count, seed=1000 + run).prompts):
            engine.add_request(RequestSpec(f"prefill-{run}-{i}", prompt, params))
        while engine.has_unfinished():
            engine.step()

    try:
        ctx.record("prefill_step_kernels", {"prompts": count, **_kernel_profile(one_step)})
    except Exception as exc:  # the profiler's event API moves between torch versions
        ctx.record("prefill_step_kernels", {"error": repr(exc)})


def _sync_points(ctx: StepContext, engine: LLMEngine) -> None:
    """Where the engine's steps make the host wait for the GPU besides reading a step's
    tokens back: CUDA's sync debug mode over a mixed workload (each prompt arriving while
    the ones before decode, steps scheduled ahead; greedy, nucleus, seeded, min_tokens and
    penalized rows together), each synchronising call counted at its innermost frame in the engine's
    code. Expected: none (design decisions "Step inputs in one copy" and "Top-p without
    waiting for the device"). Each one stalls scheduling ahead."""
    if not _cuda(ctx):
        return
    kinds = [  # greedy, nucleus, seeded top-k, min_tokens, penalties: the sampler's paths
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.7, min_tokens=4, max_tokens=8),
        SamplingParams(temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.2, max_tokens=8),
    ]
    prompts = _workload(ctx, 8, seed=2000).prompts
    steps = []

    def mixed() -> None:
        for i, prompt in enumerate(prompts):
            engine.add_request(RequestSpec(f"sync-{i}", prompt, kinds[i % len(kinds)]))
            steps.append(engine.step())  # each prompt beside the ones before, decoding
        while engine.has_unfinished():
            steps.append(engine.step())

    try:
        sites = sync_sites(mixed, str(Path(__file__).resolve().parents[2] / "worker_svc"))
        ctx.record("sync_points", {"steps": len(steps), "sites": sites})
    except Exception as exc:  # the debug mode's API moves between torch versions
        ctx.record("sync_points", {"error": repr(exc)})


def sync_sites(
    fn: Callable[[], Any], root: str, debug_mode: Callable[[int], None] | None = None
) -> dict[str, int]:
    """Calls ``fn`` with CUDA's sync debug mode on warnings (``debug_mode``: its setter,
    ``torch.cuda.set_sync_debug_mode``); each synchronising call, by its innermost frame
    under ``root`` ("path:line function", or the warning's own place when none is)."""
    import traceback
    import warnings
    from collections import Counter

    set_mode = debug_mode or torch.cuda.set_sync_debug_mode
    sites: Counter[str] = Counter()

    def show(message: Any, category: Any, filename: str, lineno: int, *_: Any, **__: Any) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(root)]
        place = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else None
        sites[place or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        set_mode(1)  # warn
        try:
            fn()
        finally:
            set_mode(0)
    return dict(sites.most_common())


def engine_graphs(ctx: StepContext) -> None:
    """The engine in-process at every concurrency, decode steps on CUDA graphs."""
    if not _cuda(ctx):
        raise Skip("CUDA graphs need CUDA (engine_eager has the in-process figures)")
    _engine_rows(ctx, cuda_graphs=True)


def engine_eager(ctx: StepContext) -> None:
    """The engine in-process at every concurrency, every step eager."""
    _engine_rows(ctx, cuda_graphs=False)


# -------------------------------------------------------------------- LoRA
LORA_ADAPTERS = 4
LORA_RANK = 16


def _random_adapters(model_dir: str, root: Path, count: int, rank: int) -> dict[str, str]:
    """``count`` random PEFT-format adapters (every projection, non-zero A and B) written
    from the model's own weight shapes, without peft; name -> directory."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    shapes: dict[str, tuple[int, ...]] = {}
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.endswith("_proj.weight") and ".layers." in key:
                    shapes[key.removesuffix(".weight")] = tuple(f.get_slice(key).get_shape())
    projections = sorted({k.rsplit(".", 1)[1] for k in shapes})
    out = {}
    for i in range(count):
        gen = torch.Generator().manual_seed(100 + i)
        tensors = {}
        for module, (fan_out, fan_in) in shapes.items():
            name = f"base_model.model.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) / rank**0.5
        directory = root / f"lora-{i}"
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": projections}
        (directory / "adapter_config.json").write_text(json.dumps(config))
        out[f"lora-{i}"] = str(directory)
    return out


def lora_mix(ctx: StepContext) -> None:
    """The engine with 4 rank-16 adapters on every projection (decode on CUDA graphs where
    there is CUDA) at the mesh's concurrency: base requests, then a uniform mix of the 4,
    beside engine_graphs' base without LoRA; then the mix's greedy tokens against the same
    engine with every step eager."""
    p, c = ctx.profile, ctx.profile.mesh_concurrency
    names = list(_random_adapters(ctx.model_dir, ctx.work / "loras", LORA_ADAPTERS, LORA_RANK).items())
    lora = {"max_loras": LORA_ADAPTERS, "max_lora_rank": LORA_RANK}
    modules = tuple(f"{n}={d}" for n, d in names)
    # Sequences up to the mix's concurrency: its steps replay the same buckets as with 256,
    # and the other 24 buckets' capture is a minute of the kit's budget.
    config = replace(
        _engine_config(ctx, cuda_graphs=_cuda(ctx)), lora_modules=modules, max_num_seqs=c, **lora
    )
    mix = [n for n, _ in names]

    async def run(engine: AsyncLLMEngine) -> None:
        engine.start()
        ctx.record("warm_up", await warm_up(engine, _workload(ctx, 5, seed=99)))
        for label, adapters in (("base_lora_on", ()), ("mix", mix)):
            workload = _workload(ctx, p.num_requests(c), seed=c)
            generate = engine_generate_fn(engine, label, adapters)
            row, _ = await run_generate_workload(generate, workload, c, "meshserve")
            ctx.record(label, asdict(row))
        ctx.record("cuda_graphs", _graph_stats(engine.engine))
        await engine.shutdown()

    asyncio.run(run(AsyncLLMEngine(config)))
    gc.collect()
    _mix_against_eager(ctx, config, mix)


def _mix_against_eager(ctx: StepContext, config: EngineConfig, mix: list[str]) -> None:
    """The LoRA mix's greedy tokens, half the prompts under an adapter, by the CUDA default
    (compiled, graphs) against the same engine eager; then, while the box allows, compiled
    without graphs against eager: which of the two moves the tokens."""
    prompts = _workload(ctx, 2 * LORA_ADAPTERS, seed=7).prompts
    adapters = [mix[i % LORA_ADAPTERS] if i % 2 else "" for i in range(len(prompts))]
    # As many sequences as prompts: a few graph buckets to capture, not every one to 256.
    small = replace(config, max_num_seqs=len(prompts), kv_cache_memory_mb=min(ctx.profile.kv_cache_mb, 1024))
    graphs, _ = _engine_greedy(small, prompts, adapters)
    gc.collect()
    eager, _ = _engine_greedy(replace(small, cuda_graphs=False, compile_model=False), prompts, adapters)
    ctx.record("mix_tokens_equal_eager", graphs == eager)
    # Where each request first leaves eager (None: never), by its adapter ("" the base model).
    ctx.record("mix_first_diffs", _first_diffs(graphs, eager, adapters))
    if small.compiles and ctx.left_s() > 60:
        gc.collect()
        compiled, _ = _engine_greedy(replace(small, cuda_graphs=False), prompts, adapters)
        ctx.record("mix_first_diffs_compiled_no_graphs", _first_diffs(compiled, eager, adapters))


def _first_diffs(got: list[list[int]], want: list[list[int]], names: list[str]) -> list[list[Any]]:
    """Per request ``[its adapter, the first token where got leaves want (None: never)]``."""
    pairs = [zip(g, w, strict=True) for g, w in zip(got, want, strict=True)]
    diffs = [next((i for i, (a, b) in enumerate(pair) if a != b), None) for pair in pairs]
    return [[name, diff] for name, diff in zip(names, diffs, strict=True)]


# -------------------------------------------------------------------- mesh
MESH_GATEWAYS = 4  # the mesh step's second run: gateway processes sharing the port


def mesh(ctx: StepContext) -> None:
    """Gateway -> scheduler -> one decoder on this device, over loopback, at one concurrency."""
    p = ctx.profile
    c = p.mesh_concurrency
    args = argparse.Namespace(model_dir=ctx.model_dir, max_batch_tokens=p.max_batch_tokens)
    env = (
        ("MESHSERVE_DEVICE", p.device),
        ("MESHSERVE_DTYPE", p.dtype),
        ("MESHSERVE_KV_CACHE_MEMORY_MB", str(p.kv_cache_mb)),
        ("MESHSERVE_MAX_MODEL_LEN", str(p.max_model_len)),
    )
    start = time.monotonic()
    (row,) = bench_mesh(args, _workload(ctx, p.num_requests(c), seed=c), [c], extra_env=env)
    ctx.record("row", asdict(row))
    ctx.record("with_start_s", round(time.monotonic() - start, 2))
    # Then with several gateway processes on the port, while the box allows: whether one
    # gateway's event loop is what holds served below in-process.
    if ctx.left_s() > 1.3 * (time.monotonic() - start):
        (row,) = bench_mesh(
            args, _workload(ctx, p.num_requests(c), seed=c), [c], extra_env=env, num_gateways=MESH_GATEWAYS
        )
        ctx.record("row_more_gateways", asdict(row))


# ---------------------------------------------------------------- hf_naive
def hf_naive(ctx: StepContext) -> None:
    """transformers ``generate`` one request at a time (sdpa attention, the profile's dtype)."""
    model = load_hf_model(ctx.model_dir, ctx.profile.dtype).to(ctx.profile.device)
    workload = _workload(ctx, ctx.profile.naive_requests, seed=1)  # the engine's first c=1 prompts
    bench_hf_naive(model, Workload(workload.prompts[:1], 2), 1)  # warm-up
    row, timings = bench_hf_naive(model, workload, ctx.profile.naive_requests)
    ctx.record("row", asdict(row))
    ctx.record("c1_tokens", [t.tokens for t in timings])


# -------------------------------------------------------------- c1_anatomy
ANATOMY_MAX_SEQS = 8  # buckets 1, 2, 4, 8: enough for a c=1 step, quick to capture (and compile)


def _anatomy_config(ctx: StepContext) -> EngineConfig:
    """The CUDA default (compiled forward in CUDA graphs), few buckets: quick to capture."""
    return replace(_engine_config(ctx, cuda_graphs=True), max_num_seqs=ANATOMY_MAX_SEQS)


def _one_request(
    engine: LLMEngine, prompt: list[int], new_tokens: int, rid: str
) -> tuple[list[int], list[float]]:
    """Greedy tokens of one request alone, and the wall time of each decode step (ms)."""
    engine.add_request(
        RequestSpec(rid, prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    )
    tokens: list[int] = []
    step_ms: list[float] = []
    while engine.has_unfinished():
        start = time.perf_counter()
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        step_ms.append((time.perf_counter() - start) * 1000)
    return tokens, step_ms[1:]  # the first step is the prefill


def _replay_ms(engine: LLMEngine, cuda: bool) -> float | None:
    """GPU time of the batch-1 graph's replay alone (CUDA events over 100 replays)."""
    graphs = engine.runner.graphs
    if graphs is None or not cuda:
        return None
    return _cuda_us(graphs._replays[graphs.buckets[0]], 100) / 1000


def _host_profile(
    engine: LLMEngine, prompt: list[int], new_tokens: int, top: int = 25
) -> list[dict[str, Any]]:
    """cProfile of one c=1 request: the functions with the most own time per decode step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    _one_request(engine, prompt, new_tokens, "anatomy-profiled")
    prof.disable()
    stats = pstats.Stats(prof).sort_stats("tottime")
    rows = [
        {
            "fn": f"{Path(path).name}:{line}({name})",
            "calls_per_step": calls / new_tokens,
            "own_us_per_step": own / new_tokens * 1e6,
            "cum_us_per_step": cum / new_tokens * 1e6,
        }
        for (path, line, name), (_, calls, own, cum, _) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    return sorted(rows, key=lambda r: -r["own_us_per_step"])[:top]


_ORDER_SHOWN = 60  # kernels listed in launch order: more than the embedding and two layers


def _kernel_profile(fn: Callable[[], Any]) -> dict[str, Any]:
    """``fn`` once under the torch profiler (CUDA activity): its kernels, their summed GPU
    time, the span from the first kernel's start to the last one's end (the difference is
    time the GPU spent between kernels), every kernel by name with the most time first, and
    the first ``_ORDER_SHOWN`` in launch order (the embedding and the first layers: which
    kernels one layer launches)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return {"kernels": 0}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:80], []).append(e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    first = sorted(kernels, key=lambda e: e.time_range.start)[:_ORDER_SHOWN]
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    return {
        "kernels": len(kernels),
        "gpu_us": round(sum(e.time_range.elapsed_us() for e in kernels), 1),
        "span_us": round(span, 1),
        "top": [{"kernel": k, "count": len(v), "us": round(sum(v), 1)} for k, v in top],
        "order": [[e.name[:60], round(e.time_range.elapsed_us(), 1)] for e in first],
    }


def _kernels(engine: LLMEngine, cuda: bool, prompt: list[int], new_tokens: int) -> dict[str, Any] | None:
    """The batch-1 forward's kernels, run outside its graph and as its graph's replay (the
    static buffers set to padding first: K/V go only to the scratch block); then those of
    ``STEP_WINDOW`` consecutive decode steps of one request (`_step_kernels`)."""
    graphs = engine.runner.graphs
    if graphs is None or not cuda:
        return None
    graphs.pad(1)
    return {
        "eager_forward": _kernel_profile(graphs._bucket_forward(1)),
        "graph_replay": _kernel_profile(graphs._replays[graphs.buckets[0]]),
        "engine_steps": _step_kernels(engine, prompt, new_tokens),
    }


STEP_WINDOW = 8  # decode steps profiled together, twice (_kernel_profile warms up once)


def _step_kernels(engine: LLMEngine, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """The GPU's work over ``STEP_WINDOW`` consecutive c=1 decode steps as the engine runs
    them (scheduled ahead): beside the graph replay's own kernels, what a step adds outside
    its graph (the step inputs' copies, the sampler) and the GPU's idle time between them."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request(RequestSpec("anatomy-steps", prompt, params))
    for _ in range(3):  # the prefill and the first decode steps
        engine.step()

    def window() -> None:
        for _ in range(STEP_WINDOW):
            engine.step()

    out = {"steps": STEP_WINDOW, **_kernel_profile(window)}
    while engine.has_unfinished():
        engine.step()
    return out


def _anatomy(ctx: StepContext) -> dict[str, Any]:
    cuda, p = _cuda(ctx), ctx.profile
    start = time.monotonic()
    engine = LLMEngine(_anatomy_config(ctx))
    warm_s = engine.warm_up()
    out: dict[str, Any] = {"load_s": round(time.monotonic() - start, 2), "warm_up_s": round(warm_s, 2)}
    out["engine"] = engine.describe()
    if cuda:
        out["gpu_mem_gb"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    prompts = _workload(ctx, 3, seed=7).prompts
    _one_request(engine, prompts[0], p.output_len, "anatomy-warm")
    tokens, step_ms = _one_request(engine, prompts[1], p.output_len, "anatomy-timed")
    out["decode_step_ms_p50"] = sorted(step_ms)[len(step_ms) // 2]
    out["tokens"] = tokens
    replay = _replay_ms(engine, cuda)
    if replay is not None:
        out["graph_replay_ms"] = replay
        out["host_ms_per_step"] = out["decode_step_ms_p50"] - replay
    out["host_profile"] = _host_profile(engine, prompts[2], p.output_len)
    try:  # the profiler's event API moves between torch versions: keep the other figures
        out["kernels"] = _kernels(engine, cuda, prompts[2], p.output_len)
    except Exception as exc:
        out["kernels"] = {"error": repr(exc)}
    out["cuda_graphs"] = _graph_stats(engine)
    del engine
    gc.collect()
    return out


def _variant(
    ctx: StepContext, config: EngineConfig, default_tokens: list[int] | None, inductor: dict[str, Any]
) -> dict[str, Any]:
    """The c=1 step, batch-1 replay and whether the tokens equal the default engine's, of
    an engine of ``config`` compiled with the inductor settings ``inductor`` on top."""
    out, tokens = _c1_run(ctx, config, inductor)
    out["tokens_equal_default"] = tokens == default_tokens
    return out


def _c1_run(
    ctx: StepContext, config: EngineConfig, inductor: dict[str, Any]
) -> tuple[dict[str, Any], list[int]]:
    """A fresh engine's c=1 step and batch-1 replay (ms), and its greedy tokens."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(inductor):
        engine = LLMEngine(config)
        engine.warm_up()
        prompts = _workload(ctx, 3, seed=7).prompts
        _one_request(engine, prompts[0], ctx.profile.output_len, "variant-warm")
        tokens, step_ms = _one_request(engine, prompts[1], ctx.profile.output_len, "variant-timed")
    out: dict[str, Any] = {"decode_step_ms_p50": sorted(step_ms)[len(step_ms) // 2]}
    out["graph_replay_ms"] = _replay_ms(engine, _cuda(ctx))
    del engine
    gc.collect()
    return out, tokens


def norm_parity(ctx: StepContext) -> None:
    """What bf16 parity with transformers costs a c=1 decode step: the default engine with
    RMSNorm's mean left to inductor (fused with the norm's other ops) instead of ATen's
    reduction, which the engine keeps so greedy tokens follow eager bf16
    (model_runner.eager_mean_reduction), also with c1_anatomy's pdl variant on Hopper (the
    two together: how near c=1 could come); then the default. Each one's step and replay,
    and the first token where the fused and the default part (None: never). That choice is
    process-wide and cannot be undone, so the fused engines run first (the kit runs each
    step in a process of its own)."""
    if not _cuda(ctx):
        raise Skip("the compiled forward in CUDA graphs needs CUDA")
    from worker_svc.engine import model_runner

    with mock.patch.object(model_runner, "eager_mean_reduction", lambda: None):
        fused, fused_tokens = _c1_run(ctx, _anatomy_config(ctx), {})
        ctx.record("inductor_mean", fused)
        if torch.cuda.get_device_capability()[0] >= 9 and ctx.left_s() > 50:  # with c1_anatomy's pdl
            ctx.record(
                "inductor_mean_pdl", _c1_run(ctx, _anatomy_config(ctx), {"triton.enable_pdl": True})[0]
            )
    default, tokens = _c1_run(ctx, _anatomy_config(ctx), {})
    ctx.record("aten_mean", default)
    ctx.record("first_diff", _first_diffs([fused_tokens], [tokens], [""])[0][1])


def c1_anatomy(ctx: StepContext) -> None:
    """Where a c=1 decode step's time goes in the default engine (on CUDA the compiled
    forward in CUDA graphs): the step's wall time, the graph replay alone (GPU), the rest
    (host), the host's top functions (cProfile) and the kernels one forward launches; then
    the step and replay with the projections merged the other way than the device's
    default (on CUDA unmerged: what merging them gains), and on CUDA with inductor's
    kernels launched as programmatic dependent launches (``pdl``: each may start while the
    one before ends; Hopper and later)."""
    graphs = _anatomy(ctx)
    variants = {"graphs": graphs}
    ctx.record("variants", variants)
    config = _anatomy_config(ctx)
    merged = config.merges_projections(ctx.profile.device)
    other = replace(config, merge_projections="off" if merged else "on")
    variants["unmerged" if merged else "merged"] = _variant(ctx, other, graphs.get("tokens"), {})
    ctx.record("variants", variants)
    if _cuda(ctx) and torch.cuda.get_device_capability()[0] >= 9 and ctx.left_s() > 40:
        variants["pdl"] = _variant(ctx, config, graphs.get("tokens"), {"triton.enable_pdl": True})
        ctx.record("variants", variants)


def host_overhead(ctx: StepContext) -> None:
    """The engine's host work per decode step with the forward stubbed out
    (bench.host_overhead) on this device, steps eager and through the decode graphs'
    buffers: input tensors made on it, the sampler's argmax and its copy back included;
    the tests' tiny model, so the device's arithmetic is nil. Then through the graphs'
    buffers with every request penalized (``PENALIZED``: Qwen2.5's default repetition
    penalty and a frequency penalty), the penalty table's work on the device included."""
    from bench.host_overhead import NO_PENALTIES, PENALIZED, build_model, measure

    model = build_model(ctx.work / "host-overhead-model")
    p = ctx.profile
    args = argparse.Namespace(
        steps=p.host_steps, rounds=1, prompt_tokens=p.prompt_len, profile_at=0, **NO_PENALTIES
    )
    for c, row in measure(str(model), p.device, p.host_concurrencies, args).items():
        ctx.record(f"c{c}_host_ms_per_step", row["median_ms"])
    for c, row in measure(str(model), p.device, p.host_concurrencies, args, graphs=True).items():
        ctx.record(f"c{c}_graph_host_ms_per_step", row["median_ms"])
    penalized = argparse.Namespace(**{**vars(args), **PENALIZED})
    for c, row in measure(str(model), p.device, p.host_concurrencies, penalized, graphs=True).items():
        ctx.record(f"c{c}_penalized_graph_host_ms_per_step", row["median_ms"])
