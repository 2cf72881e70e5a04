"""CPU steps in bf16 run at a fixed set of token counts, each warmed before ready: oneDNN
builds its kernels per token count on first use (docs/design-decisions.md, "CPU steps are
padded to step sizes")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters

from tests.worker_engine.conftest import prompts, run_all, tokens
from worker_svc.engine import LLMEngine, SamplingParams
from worker_svc.engine.model_runner import cpu_step_sizes

Factory = Callable[..., LLMEngine]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _record_step_tokens(engine: LLMEngine) -> list[int]:
    """The token count of every forward the runner runs from now on."""
    seen: list[int] = []
    forward = engine.runner.model_forward

    def spy(**kwargs: Any) -> Any:
        seen.append(kwargs["input_ids"].shape[1])
        return forward(**kwargs)

    engine.runner.model_forward = spy  # type: ignore[method-assign]
    return seen


def _real_blocks(engine: LLMEngine, layer: int) -> torch.Tensor:
    """Layer ``layer``'s K/V of the blocks requests hold (the scratch block is the last)."""
    return engine.runner.kv_caches[layer][:, : engine.runner.scratch_block]


def test_step_sizes_every_count_to_16_multiples_of_16_to_256_then_8_per_doubling() -> None:
    assert cpu_step_sizes(512) == (*range(1, 17), *range(32, 257, 16), *range(288, 513, 32))
    assert cpu_step_sizes(8192)[-9:] == (*range(4096, 8193, 512),)
    assert cpu_step_sizes(40) == (*range(1, 17), 32, 40), "the budget itself is a size"
    assert cpu_step_sizes(8) == tuple(range(1, 9))


def test_float32_steps_are_not_padded(make_engine: Factory) -> None:
    """float32 linears go to MKL's sgemm, which has no per-shape set-up: nothing to pad."""
    engine = make_engine(dtype="float32")
    assert engine.runner.step_sizes == ()
    assert engine.warm_up() == 0.0


def test_bf16_steps_are_padded_and_padding_changes_nothing(make_engine: Factory) -> None:
    """Batched prompts (prefill chunks beside decodes): every forward runs at a step size,
    and the tokens and every real KV block equal those of the same engine unpadded."""
    ps = prompts(5, 23, 41, 37, seed=11)
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
    padded = make_engine(dtype="bfloat16", max_num_batched_tokens=64)
    seen = _record_step_tokens(padded)
    outs = run_all(padded, requests)
    plain = make_engine(dtype="bfloat16", max_num_batched_tokens=64)
    plain.runner.step_sizes = ()
    plain_seen = _record_step_tokens(plain)
    plain_outs = run_all(plain, requests)
    assert set(seen) <= set(padded.runner.step_sizes)
    assert set(plain_seen) - set(seen), "no step of this batch needed padding: the test proves nothing"
    assert {r: tokens(o) for r, o in outs.items()} == {r: tokens(o) for r, o in plain_outs.items()}
    for layer in range(padded.model_info.num_layers):
        assert torch.equal(_real_blocks(padded, layer), _real_blocks(plain, layer)), f"layer {layer}"


def test_warm_up_runs_each_step_size_into_the_scratch_block_only(make_engine: Factory) -> None:
    """Padding rows may write K/V of value 0 (token 0 at position 0): the real blocks are
    filled with a sentinel first, so that any write to them shows."""
    engine = make_engine(dtype="bfloat16", max_num_batched_tokens=40)
    for layer in range(engine.model_info.num_layers):
        _real_blocks(engine, layer).fill_(1.0)
    seen = _record_step_tokens(engine)
    assert engine.warm_up() > 0
    assert seen == list(engine.runner.step_sizes)
    assert engine.stats().num_free_blocks == engine.model_info.num_kv_blocks
    for layer in range(engine.model_info.num_layers):
        assert (_real_blocks(engine, layer) == 1.0).all(), f"warm-up wrote a real block of layer {layer}"


def test_compiled_warm_up_adds_no_graph_for_step_sizes(make_engine: Factory) -> None:
    """The step sizes run the one graph the compile warm-up made: a guard they failed
    would compile a graph per size class on every start."""
    engine = make_engine(dtype="bfloat16", compile_model=True, max_num_batched_tokens=20)
    graphs = counters["stats"]["unique_graphs"]
    engine.warm_up()
    assert counters["stats"]["unique_graphs"] - graphs == 1
