"""Merged q/k/v and gate/up projections (worker_svc.engine.merged_projections): the same
output as the separate projections, one matmul per group (eager and compiled), and a group
whose projections read different inputs unmerged by the load-time check."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

from worker_svc.engine import LLMEngine, RequestSpec, SamplingParams
from worker_svc.engine.merged_projections import MergedPart, check_merged, merge_projections

_MATMULS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func in _MATMULS
        return func(*args, **(kwargs or {}))


def _forward(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    with torch.inference_mode(), _CountMatmuls() as counter:
        logits = model(input_ids=ids, use_cache=False).logits
    return logits, counter.count


def test_merged_model_gives_the_separate_projections_logits_with_three_fewer_matmuls_per_layer(
    hf_model: LlamaForCausalLM,
) -> None:
    ids = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(3))
    want, separate = _forward(hf_model, ids)
    model = copy.deepcopy(hf_model)
    groups = merge_projections(model)
    layers = model.config.num_hidden_layers
    assert len(groups) == 2 * layers
    got, merged = _forward(model, ids)
    assert check_merged(model, groups) == groups
    assert separate - merged == 3 * layers
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Compiled: the parts trace into one product per group, with no graph break.
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        out = compiled(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert all(g._product.input is None for g in groups)  # no activation held after a call


class _SplitInputs(nn.Module):
    """An attention-like module whose k and v read another input than q (cross-attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, n) for n in (8, 4, 4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(memory), self.v_proj(memory)], -1)


def test_a_group_whose_projections_read_different_inputs_is_unmerged_and_stays_right() -> None:
    torch.manual_seed(0)
    module = _SplitInputs()
    x, memory = torch.randn(3, 8), torch.randn(3, 8)
    want = module(x, memory)
    groups = merge_projections(module)
    assert len(groups) == 1 and isinstance(module.k_proj, MergedPart)
    torch.testing.assert_close(module(x, memory), want)  # right even while merged
    assert check_merged(module, groups) == []
    assert not module.k_proj.merged_on
    with _CountMatmuls() as counter:
        got = module(x, memory)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counter.count == 3  # each part its own rows of the merged weight


@pytest.mark.parametrize("linear", [nn.Linear(8, 8, bias=False), nn.Identity()])
def test_groups_of_unlike_projections_are_left_alone(linear: nn.Module) -> None:
    module = _SplitInputs()
    module.v_proj = linear  # no bias beside biased siblings / not a linear at all
    assert merge_projections(module) == []
    assert not hasattr(module, "qkv_proj")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_engine_with_merged_projections_gives_the_separate_ones_tokens(
    make_engine: Callable[..., LLMEngine], compiled: bool
) -> None:
    """merge_projections on (CUDA's default) against off (CPU's): the same greedy tokens."""
    got = {}
    for merge in ("off", "on"):
        engine = make_engine(merge_projections=merge, compile_model=compiled, max_num_batched_tokens=64)
        assert len(engine.runner.merged) == (4 if merge == "on" else 0)  # 2 layers x 2 groups
        assert f"{len(engine.runner.merged)} merged projection groups" in engine.describe()
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for i, n in enumerate((5, 21, 3)):
            engine.add_request(RequestSpec(str(i), [(7 * i + j) % 500 + 3 for j in range(n)], params))
        outs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        got[merge] = outs
    assert got["on"] == got["off"] and all(len(t) == 16 for t in got["on"].values())
