"""Engine side of E/PD disaggregation: the decoder loads only the language model of a
LLaVA-style checkpoint, merges precomputed image embeddings into (chunked) prefill, and
never shares KV blocks between prompts with different images."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multimodal.conftest import ReferenceBuilder, png_bytes
from worker_svc.engine import EngineConfig, LLMEngine, RequestOutput, RequestSpec, SamplingParams
from worker_svc.engine.attention import ATTN_IMPL_NAME
from worker_svc.engine.multimodal import MultiModalInput

GREEDY = SamplingParams(temperature=0, max_tokens=10)
Factory = Callable[..., LLMEngine]


@pytest.fixture
def make_engine(vlm_dir: Path) -> Iterator[Factory]:
    torch.set_num_threads(1)
    engines: list[LLMEngine] = []

    def factory(**overrides: Any) -> LLMEngine:
        config = EngineConfig(
            model_dir=str(vlm_dir), num_kv_blocks=64, block_size=8, **{"compile_model": False, **overrides}
        )
        engines.append(LLMEngine(config))
        return engines[-1]

    yield factory
    for engine in engines:
        assert engine.block_manager.num_used_blocks() == 0, "test leaked KV blocks"


def _mm(refs: ReferenceBuilder, png: bytes, identifier: str) -> tuple[list[int], MultiModalInput, list[int]]:
    ref = refs.reference(png)
    item = MultiModalInput(identifier, ref.image_offset, refs.seq_length, refs.embeddings(ref))
    return ref.prompt, item, refs.greedy(ref, GREEDY.max_tokens)


def _run(
    engine: LLMEngine, requests: list[tuple[str, list[int], MultiModalInput]]
) -> dict[str, RequestOutput]:
    for rid, prompt, item in requests:
        engine.add_request(RequestSpec(rid, prompt, GREEDY, mm_inputs=[item]))
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            last[out.request_id] = out
    for rid, out in last.items():
        out.new_token_ids = tokens[rid]  # all tokens, for the assertions
    return last


def test_decoder_loads_only_the_language_model(make_engine: Factory) -> None:
    engine = make_engine()
    model = engine.runner.model
    names = [name for name, _ in model.named_parameters()]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not [n for n in names if "vision" in n or "projector" in n]
    assert model.config._attn_implementation == ATTN_IMPL_NAME
    assert engine.model_info.hidden_size == 64


def test_chunked_prefill_with_image_matches_transformers(
    make_engine: Factory, refs: ReferenceBuilder
) -> None:
    cases = [_mm(refs, png_bytes(seed), f"img-{seed}") for seed in (1, 2)]
    assert cases[0][2] != cases[1][2], "different images should change the output"
    for budget in (7, 512):  # 7: prefill chunks split the 16 image rows
        engine = make_engine(max_num_batched_tokens=budget)
        outs = _run(engine, [(f"r{i}", prompt, item) for i, (prompt, item, _) in enumerate(cases)])
        for i, (_, _, expected) in enumerate(cases):
            assert outs[f"r{i}"].new_token_ids == expected, f"budget {budget}, image {i}"


def test_prefix_cache_never_shares_blocks_across_images(make_engine: Factory, refs: ReferenceBuilder) -> None:
    prompt_a, item_a, expected_a = _mm(refs, png_bytes(3), "img-a")
    prompt_b, item_b, expected_b = _mm(refs, png_bytes(4), "img-b")
    assert prompt_a == prompt_b  # identical token ids: only the image differs
    engine = make_engine()
    first = _run(engine, [("a1", prompt_a, item_a)])["a1"]
    other = _run(engine, [("b1", prompt_b, item_b)])["b1"]
    again = _run(engine, [("a2", prompt_a, item_a)])["a2"]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    assert first.new_token_ids == expected_a == again.new_token_ids
    assert other.new_token_ids == expected_b


def test_mm_inputs_are_validated(make_engine: Factory, refs: ReferenceBuilder) -> None:
    prompt, item, _ = _mm(refs, png_bytes(5), "img-v")
    engine = make_engine()
    bad_shape = MultiModalInput("x", item.offset, item.length, item.embeddings[:, :8])
    with pytest.raises(ValueError, match="shape"):
        engine.add_request(RequestSpec("v1", prompt, GREEDY, mm_inputs=[bad_shape]))
    outside = MultiModalInput("x", len(prompt) - 2, item.length, item.embeddings)
    with pytest.raises(ValueError, match="outside the prompt"):
        engine.add_request(RequestSpec("v2", prompt, GREEDY, mm_inputs=[outside]))
    engine.add_request(RequestSpec("v3", prompt, GREEDY, mm_inputs=[item]))
    assert engine.requests["v3"].extra_keys == ("mm:img-v",)
    engine.abort_request("v3")
    engine.step()
