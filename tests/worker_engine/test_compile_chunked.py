"""torch.compile with chunked prefill: steps made only of non-final prefill chunks need no
logits, yet every layer must still store its K/V (a compiled graph without an output row
once dropped the attention ops as dead code: wrong tokens from the next chunk on)."""

from __future__ import annotations

from collections.abc import Callable

from transformers import LlamaForCausalLM

from tests.worker_engine.conftest import hf_greedy, prompts, run_all, tokens
from worker_svc.engine import LLMEngine, SamplingParams


def test_compiled_chunked_prefill_matches_transformers(
    make_engine: Callable[..., LLMEngine], hf_model: LlamaForCausalLM
) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (prompt,) = prompts(27, seed=11)
    engine = make_engine(compile_model=True, max_num_batched_tokens=8, block_size=4)
    out = run_all(engine, [("r", prompt, params)])["r"]
    assert tokens(out) == hf_greedy(hf_model, prompt, 4)
    assert engine.runner.compile_seconds > 0
