"""CUDA graphs for decode steps (worker_svc/engine/cuda_graphs.py).

On CPU the graph is replaced by its one part CPU cannot produce: the recorded kernels. The
test capture returns the captured function itself, so each "replay" reruns the same
forward on the same static buffers; bucket choice, padding, the scratch block, the
per-step fill and the eager fallbacks are the real code. On CUDA the last test captures
real graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.worker_engine.conftest import _ENGINES, WarmedUp, prompts, run_all, tokens
from worker_svc.engine import LLMEngine, SamplingParams, cpu_attention, triton_attention
from worker_svc.engine.attention import AttentionMetadata
from worker_svc.engine.cuda_graphs import GRAPH_BACKENDS, DecodeGraphs, attach, bucket_sizes, capture_graphs

# The graph backends this machine runs: the native CPU kernel, and the Triton kernel with
# CUDA or under TRITON_INTERPRET=1 (test_triton_interpret.py runs the triton case so).
BACKENDS = [
    pytest.param("cpu", marks=pytest.mark.skipif(cpu_attention.load() is None, reason="needs a C compiler")),
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not triton_attention.HAS_TRITON
            or not (torch.cuda.is_available() or triton_attention.interpreting()),
            reason="needs triton with CUDA or TRITON_INTERPRET=1",
        ),
    ),
]

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def call_again(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The CPU stand-in of a graph: replay reruns the captured function."""
    return fn


def _run(engine: LLMEngine, lengths: tuple[int, ...]) -> dict[str, list[int]]:
    vocab = engine.model_info.vocab_size
    reqs = [(f"r{i}", [t % vocab for t in p], PARAMS) for i, p in enumerate(prompts(*lengths))]
    return {rid: tokens(outs) for rid, outs in run_all(engine, reqs).items()}


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert bucket_sizes(64) == (1, 2, 4, *range(8, 65, 8))


def test_off_on_cpu(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    assert engine.config.cuda_graphs  # on by default, a no-op without CUDA
    assert engine.runner.graphs is None and "need CUDA" in engine.runner.graphs_note


@pytest.mark.parametrize("lengths", [(5, 17, 3, 30, 9), (12,)], ids=["5-seqs", "1-seq"])
def test_replayed_decode_equals_eager(
    make_engine: Callable[..., LLMEngine], lengths: tuple[int, ...]
) -> None:
    eager = make_engine(attention_backend="cpu", max_num_seqs=6, block_size=4, max_num_batched_tokens=16)
    expected = _run(eager, lengths)
    engine = make_engine(attention_backend="cpu", max_num_seqs=6, block_size=4, max_num_batched_tokens=16)
    graphs = attach(engine.runner, call_again)
    assert graphs.buckets == (1, 2, 4, 6)
    # The largest bucket's capture is timed apart (it initialises lazily).
    assert 0 < graphs.capture_largest_s < graphs.capture_s and "capture_largest_s" in graphs.stats()
    assert _run(engine, lengths) == expected
    # Prefill and mixed steps ran eagerly; every decode-only step replayed, padded to its bucket.
    assert 0 < graphs.replays < engine.stats().num_steps
    assert (graphs.padded_rows > 0) == (len(lengths) == 5)  # 5 rows pad to 6, 3 to 4
    # Real blocks hold the same K/V as eagerly; only the scratch block saw the padding rows.
    scratch = engine.runner.scratch_block
    for got, want in zip(engine.runner.kv_caches, eager.runner.kv_caches, strict=True):
        torch.testing.assert_close(got[:, :scratch], want[:, :scratch], rtol=1e-5, atol=1e-5)
    if graphs.padded_rows:
        assert engine.runner.kv_caches[0][:, scratch].abs().sum() > 0
        assert eager.runner.kv_caches[0][:, scratch].abs().sum() == 0


def test_lora_rows_replay_like_eager(
    make_engine: Callable[..., LLMEngine], engine_model_dir: str, tmp_path: Any
) -> None:
    """With LoRA on, decode steps of base and adapter rows together replay the graphs
    (the step's slot mask is a static buffer) and answer as the eager engine does."""
    from tests.lora_kit import build_adapters
    from worker_svc.engine import RequestSpec

    modules = tuple(f"{n}={p}" for n, p in build_adapters(engine_model_dir, tmp_path).items())
    kwargs: dict[str, Any] = {"attention_backend": "cpu", "max_num_seqs": 6, "block_size": 4}
    kwargs.update(max_num_batched_tokens=16, max_loras=2, lora_modules=modules)
    eager, engine = make_engine(**kwargs), make_engine(**kwargs)
    graphs = attach(engine.runner, call_again)
    names = ["", "ad-all", "ad-mlp", "", "ad-all"]

    def answers(e: LLMEngine, names: list[str]) -> dict[str, list[int]]:
        for i, (p, name) in enumerate(zip(prompts(5, 17, 3, 30, 9, seed=4), names, strict=True)):
            e.add_request(RequestSpec(f"r{i}", p, PARAMS, lora_name=name))
        outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(names))}
        while e.has_unfinished():
            for out in e.step():
                outs[out.request_id] += out.new_token_ids
        return outs

    want = answers(eager, names)
    assert answers(engine, names) == want
    assert graphs.replays > 0 and graphs.lora_mask is not None
    no_lora = make_engine(attention_backend="cpu", max_num_seqs=6, block_size=4, max_num_batched_tokens=16)
    assert answers(no_lora, [""] * 5)["r1"] != want["r1"], (
        "the adapter changes nothing: the test proves nothing"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_windowed_model_replays_like_eager(tmp_path: Any, backend: str) -> None:
    from transformers import AutoModelForCausalLM

    from devtools.arch_matrix import CASES, build_config
    from worker_svc.engine import EngineConfig

    case = next(c for c in CASES if c.name == "Gemma 3")  # sliding window of 8, shorter than the prompts
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config(case), dtype=torch.float32).save_pretrained(tmp_path)
    # Eager: the replay's windowed attention is what is checked here, not the compiler.
    config = EngineConfig(
        model_dir=str(tmp_path),
        block_size=4,
        num_kv_blocks=64,
        dtype="float32",
        max_num_seqs=4,
        compile_model=False,
    )
    eager, engine = LLMEngine(config), LLMEngine(config)
    _ENGINES.extend((eager, engine))
    graphs = attach(engine.runner, call_again)
    lengths = (27, 5, 14)
    assert _run(engine, lengths) == _run(eager, lengths)
    assert graphs.replays > 0


def test_decode_graphs_replay_the_compiled_graph_of_eager_steps(warmed_up: WarmedUp) -> None:
    """A compiled forward captured in graphs is the graph eager steps compiled (same
    arguments, contiguous inputs at every bucket): capturing compiles nothing more."""
    from torch._dynamo.utils import counters

    engine = warmed_up.engine
    if engine.model_info.attention_backend not in GRAPH_BACKENDS:
        pytest.skip(f"graphs need {GRAPH_BACKENDS}, the engine has {engine.model_info.attention_backend}")
    expected = _run(engine, (5, 17, 3))
    compiled = counters["stats"]["unique_graphs"]

    def run_at_capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        fn()  # as a real capture runs it: every bucket's forward once
        return fn

    graphs = attach(engine.runner, run_at_capture)
    try:
        assert counters["stats"]["unique_graphs"] == compiled, "capturing compiled another graph"
        assert _run(engine, (5, 17, 3)) == expected
        assert graphs.replays > 0 and counters["stats"]["unique_graphs"] == compiled
    finally:
        engine.runner.graphs = None


@pytest.mark.skipif(cpu_attention.load() is None, reason="needs a C compiler")
def test_a_compiler_failure_inside_the_capture_captures_the_eager_forward(
    make_engine: Callable[..., LLMEngine],
) -> None:
    eager = make_engine(attention_backend="cpu", max_num_seqs=6, compile_model=False)
    expected = _run(eager, (5, 17, 3))
    engine = make_engine(attention_backend="cpu", max_num_seqs=6, compile_model=True)
    runner = engine.runner

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if not runner.compile_failed:  # as the compiler would, raising inside the capture
            raise RuntimeError("inductor failed")
        return fn

    graphs, note = capture_graphs(runner, capture)
    assert graphs is not None and note == "" and runner.graphs is graphs
    assert runner.compile_failed == "compile failed: RuntimeError"
    assert _run(engine, (5, 17, 3)) == expected and graphs.replays > 0


def _recording_graphs(buckets: tuple[int, ...]) -> tuple[DecodeGraphs, list[AttentionMetadata]]:
    seen: list[AttentionMetadata] = []

    def forward(
        meta: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor, mask: Any, rows: torch.Tensor
    ) -> torch.Tensor:
        seen.append(meta)
        return ids[0].float().unsqueeze(1).repeat(1, 3)  # "logits": each row's token id

    graphs = DecodeGraphs(
        forward,
        buckets=buckets,
        kv_caches=[],
        block_size=4,
        max_model_len=32,
        scratch_block=9,
        backend="cpu",
        layer_windows=(),
        device=torch.device("cpu"),
    )
    graphs.capture(call_again)
    return graphs, seen


def test_padding_rows_point_at_the_scratch_block() -> None:
    graphs, _ = _recording_graphs((1, 4))
    chunks = [(5, 1, [3, 7]), (0, 1, [2]), (9, 1, [1, 4, 6])]
    logits = graphs.run(chunks, [11, 12, 13], [5, 0, 9], [0, 1, 2])
    assert logits is not None and logits[:, 0].tolist() == [11, 12, 13]
    assert graphs.input_ids[:4].tolist() == [11, 12, 13, 11]
    assert graphs.positions[:4].tolist() == [5, 0, 9, 0]
    assert graphs.slots[:4].tolist() == [7 * 4 + 1, 2 * 4, 6 * 4 + 1, 9 * 4]
    assert graphs.lens[:4].tolist() == [6, 1, 10, 1]
    assert graphs.tables[:4, :3].tolist() == [[3, 7, 9], [2, 9, 9], [1, 4, 6], [9, 9, 9]]
    assert graphs.padded_rows == 1


def test_pad_turns_rows_back_into_padding() -> None:
    graphs, _ = _recording_graphs((1, 4))
    assert graphs.slots.tolist() == [9 * 4] * 4 and graphs.lens.tolist() == [1] * 4  # built as padding
    graphs.run([(5, 1, [3, 7]), (0, 1, [2]), (9, 1, [1, 4, 6])], [11, 12, 13], [5, 0, 9], [0, 1, 2])
    graphs.pad(2)
    assert graphs.slots[:3].tolist() == [9 * 4, 9 * 4, 6 * 4 + 1]
    assert graphs.tables[:3, :3].tolist() == [[9, 9, 9], [9, 9, 9], [1, 4, 6]]
    assert graphs.lens[:3].tolist() == [1, 1, 10]


def test_a_step_sends_only_the_table_entries_that_changed() -> None:
    """The static tables keep each row's blocks between steps: a row still holding its
    request's table gets the blocks appended since, another request's table is written
    whole, a row turning to padding gets the scratch block; slots and lengths follow."""
    graphs, _ = _recording_graphs((1, 4))
    a, b, c = [3, 7], [2], [1, 4, 6]
    graphs.run([(5, 1, a), (0, 1, b), (9, 1, c)], [11, 12, 13], [5, 0, 9], [0, 1, 2])
    sent: list[list[int]] = []
    edits = graphs._table_edits

    def recorded(chunks: Any, size: int) -> list[int]:
        sent.append(edits(chunks, size))
        return sent[-1]

    graphs._table_edits = recorded  # type: ignore[method-assign]
    a.append(8)  # a's request crossed into a new block
    graphs.run([(8, 1, a), (1, 1, b), (10, 1, c)], [11, 12, 13], [8, 1, 10], [0, 1, 2])
    assert sent[-1] == [0, 2, 8]
    assert graphs.slots[:4].tolist() == [8 * 4, 2 * 4 + 1, 6 * 4 + 2, 9 * 4]
    assert graphs.lens[:4].tolist() == [9, 2, 11, 1]
    # b finished: c moves up a row (written whole), row 2 turns to padding.
    graphs.run([(9, 1, a), (11, 1, c)], [11, 13], [9, 11], [0, 1])
    assert sent[-1] == [1, 0, 1, 1, 1, 4, 1, 2, 6, 2, 0, 9]
    # The padding row reads only its first column (length 1); the rest keeps c's old ids.
    assert graphs.tables[:3, :3].tolist() == [[3, 7, 8], [1, 4, 6], [9, 4, 6]]
    assert graphs.slots[:2].tolist() == [8 * 4 + 1, 6 * 4 + 3] and graphs.lens[:2].tolist() == [10, 12]
    # A freed table is a new list: the same row then takes it whole, though as long as before.
    graphs.run([(9, 1, [5, 0, 2]), (11, 1, c)], [11, 13], [9, 11], [0, 1])
    assert sent[-1] == [0, 0, 5, 0, 1, 0, 0, 2, 2]
    assert graphs.slots[0].item() == 2 * 4 + 1


def test_steps_outside_the_buckets_fall_back() -> None:
    graphs, _ = _recording_graphs((1, 2))
    decode = [(4, 1, [0, 1]), (2, 1, [2]), (3, 1, [3])]
    assert graphs.run(decode, [1, 2, 3], [4, 2, 3], [0, 1, 2]) is None  # 3 > largest bucket
    assert graphs.oversize == 1
    assert graphs.run([(0, 2, [0])], [1, 2], [0, 1], [1]) is None  # a prefill chunk
    assert graphs.run([(4, 1, [0, 1])], [1], [4], []) is None  # a row not sampled
    assert graphs.replays == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_cuda_graphs_equal_eager(engine_model_dir: str) -> None:
    from worker_svc.engine import EngineConfig

    kwargs: dict[str, Any] = {"model_dir": engine_model_dir, "num_kv_blocks": 128, "dtype": "float32"}
    kwargs.update(device="cuda", attention_backend="triton", max_num_seqs=8)
    eager = LLMEngine(EngineConfig(**kwargs, cuda_graphs=False))
    engine = LLMEngine(EngineConfig(**kwargs))
    assert engine.runner.graphs is not None, engine.runner.graphs_note
    lengths = (5, 17, 3, 30, 9)
    assert _run(engine, lengths) == _run(eager, lengths)
    assert engine.runner.graphs.replays > 0
