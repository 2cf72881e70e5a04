"""Prompt logprobs computed by the engine during prefill, against transformers' own
log-softmax of the prompt (fp32): chunked prefill, prefix-cache hits, ranks and top-K."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.worker_engine.conftest import prompts, run_all
from worker_svc.engine import LLMEngine, RequestOutput, RequestSpec, SamplingParams
from worker_svc.engine import engine as engine_module
from worker_svc.engine.sampling import TokenLogprob

Factory = Callable[..., LLMEngine]
K = 4


def _reference(hf_model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax of every prompt position (fp32)."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)


def _assert_matches(plp: list[TokenLogprob] | None, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert plp is not None and len(plp) == len(prompt) - 1
    for j, (tok, lp, top, rank) in enumerate(plp):
        row = ref[j]
        assert tok == prompt[j + 1]
        assert math.isclose(lp, row[tok].item(), abs_tol=1e-4), f"position {j}"
        assert rank == int((row > row[tok]).sum()) + 1, f"rank at position {j}"
        assert [t for t, _ in top] == row.topk(k).indices.tolist(), f"top-{k} at position {j}"
        assert all(math.isclose(v, row[t].item(), abs_tol=1e-4) for t, v in top)


def _prompt_logprobs(engine: LLMEngine, rid: str, prompt: list[int], k: int = K) -> list[TokenLogprob] | None:
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k)
    outs = run_all(engine, [(rid, prompt, params)])[rid]
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert outs[0].num_cached_tokens == 0  # no prefix-cache hit for its own prefill
    return outs[0].prompt_logprobs


@pytest.mark.parametrize("budget", [512, 7], ids=["whole", "chunked"])
def test_prompt_logprobs_with_and_without_prefix_hit(
    make_engine: Factory, hf_model: LlamaForCausalLM, budget: int
) -> None:
    engine = make_engine(max_num_batched_tokens=budget)
    prompt = prompts(53, seed=21)[0]  # 3 full 16-token blocks: a cached prefix is there to hit
    ref = _reference(hf_model, prompt)
    _assert_matches(_prompt_logprobs(engine, "cold", prompt), prompt, ref, K)
    # The same prompt again: its blocks are cached now (first by a plain request too).
    plain = run_all(engine, [("plain", prompt, SamplingParams(temperature=0, max_tokens=2))])["plain"]
    assert plain[0].num_cached_tokens == 48
    _assert_matches(_prompt_logprobs(engine, "warm", prompt), prompt, ref, K)
    if budget < len(prompt):
        assert engine.stats().num_steps > len(prompt) // budget


def test_rows_scored_in_slices(
    make_engine: Factory, hf_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's log-softmax runs a few rows at a time (memory bound): same result."""
    monkeypatch.setattr(engine_module, "PROMPT_LOGPROB_ROWS", 3)
    engine = make_engine(max_num_batched_tokens=16)
    prompt = prompts(40, seed=22)[0]
    _assert_matches(_prompt_logprobs(engine, "s", prompt, k=1), prompt, _reference(hf_model, prompt), 1)


def test_zero_alternatives_and_preemption_keep_one_entry_per_token(
    make_engine: Factory, hf_model: LlamaForCausalLM
) -> None:
    """prompt_logprobs=0: the prompt token's logprob and rank, no alternatives; a request
    preempted after its prefill recomputes from the prefix cache without sending them again."""
    engine = make_engine(num_kv_blocks=6, max_num_batched_tokens=32)
    long_prompt, other = prompts(40, 30, seed=23)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=0)
    preempted = 0
    engine.add_request(RequestSpec("b", other, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    engine.add_request(RequestSpec("a", long_prompt, params))  # arrives last: the one preempted
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        if "a" in engine.requests:
            preempted = max(preempted, engine.requests["a"].num_preemptions)
        outs.extend(o for o in engine.step() if o.request_id == "a")
    assert preempted > 0
    _assert_matches(outs[0].prompt_logprobs, long_prompt, _reference(hf_model, long_prompt), 0)
    assert sum(o.prompt_logprobs is not None for o in outs) == 1
