"""torch.compile with chunked prefill: steps made only of non-final prefill chunks need no
logits, yet every layer must still store its K/V (a compiled graph without an output row
once dropped the attention ops as dead code: wrong tokens from the next chunk on)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.worker_engine.conftest import WarmedUp, hf_greedy, prompts, run_all, tokens
from worker_svc.engine import LLMEngine, SamplingParams


def test_compiled_chunked_prefill_matches_transformers(
    warmed_up: WarmedUp, hf_model: LlamaForCausalLM
) -> None:
    """A prompt of 2.5 step budgets: two steps of one prefill chunk each, which sample nothing."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = warmed_up.engine
    (prompt,) = prompts(engine.config.max_num_batched_tokens * 5 // 2, seed=11)
    steps = engine.num_steps
    out = run_all(engine, [("r", prompt, params)])["r"]
    assert tokens(out) == hf_greedy(hf_model, prompt, 4)
    assert engine.num_steps - steps == 3 + 3, "three prefill steps, then three decode steps"
    assert engine.runner.compile_seconds > 0


def test_a_model_the_compiler_fails_on_is_served_eagerly(
    make_engine: Callable[..., LLMEngine], hf_model: LlamaForCausalLM, caplog: pytest.LogCaptureFixture
) -> None:
    """Compile is on by default: a forward inductor cannot compile (faked: the real compiler
    handles every tested architecture) must not keep the worker from serving. The warm-up's
    failure switches the engine to eager, leaves no request or block behind, and says why."""
    engine = make_engine(compile_model=True)

    def failing_compile(**_: object) -> None:
        raise RuntimeError("inductor lowering failed")

    engine.runner._compiled = failing_compile
    with caplog.at_level(logging.INFO, logger="worker_svc.engine.engine"):
        engine.warm_up()
    assert "compiling the forward failed" in caplog.text and "forward compiled" not in caplog.text
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks() == 0
    assert "no (compile failed: RuntimeError)" in engine.describe()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (prompt,) = prompts(19, seed=3)
    assert tokens(run_all(engine, [("r", prompt, params)])["r"]) == hf_greedy(hf_model, prompt, 4)


def test_two_compiled_engines_in_one_process_keep_their_own_models(
    warmed_up: WarmedUp, make_engine: Callable[..., LLMEngine], hf_model: LlamaForCausalLM, tmp_path: Path
) -> None:
    """The compiled forward checks no guard on the model (runtime_guards): a second engine
    compiling another model of the same class once ran the first one's graph (its frozen
    weights; out-of-range token ids past the first's vocabulary). Each keeps its own."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (prompt,) = prompts(15, seed=5)
    first = warmed_up.engine
    assert tokens(run_all(first, [("a", prompt, params)])["a"]) == hf_greedy(hf_model, prompt, 4)
    torch.manual_seed(0)
    other = LlamaForCausalLM(LlamaConfig(**{**hf_model.config.to_dict(), "vocab_size": 700}))
    other.save_pretrained(tmp_path)
    second = make_engine(compile_model=True, model_dir=str(tmp_path))
    wide = [*prompt[:-1], 650]  # an id only the second model's vocabulary has
    assert tokens(run_all(second, [("b", wide, params)])["b"]) == hf_greedy(other.eval(), wide, 4)
