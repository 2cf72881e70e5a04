"""Fixtures: a tiny random Llama saved to disk, engine factories that check for leaks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from worker_svc.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

VOCAB = 512
EOS = 2


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """hidden 64, 2 layers, 4 heads / 2 kv heads (GQA), vocab 512, saved with save_pretrained."""
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
        # Wider init than the default 0.02 gives peaked logits: greedy ties (and so
        # float-noise flips between implementations) become vanishingly unlikely.
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: str) -> LlamaForCausalLM:
    """The same weights loaded with stock transformers attention (the reference)."""
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


_ENGINES: list[LLMEngine] = []


@pytest.fixture(autouse=True)
def _no_leaked_blocks() -> Iterator[None]:
    """Every engine a test made must end with all KV blocks released.

    Also pins torch to one intra-op thread for the test: the tiny model gains nothing
    from parallelism, and on a loaded 2-core box OpenMP barriers cost milliseconds/op.
    """
    _ENGINES.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    engines = list(_ENGINES)
    _ENGINES.clear()
    for engine in engines:
        assert engine.block_manager.num_used_blocks() == 0, "test leaked KV blocks"


@pytest.fixture
def make_engine(tiny_model_dir: str) -> Callable[..., LLMEngine]:
    """Factory: ``make_engine(**EngineConfig overrides)``; float32 (the reference's dtype) and
    eager unless overridden, whatever ``dtype="auto"`` and ``compile_model`` default to."""

    def factory(**overrides: Any) -> LLMEngine:
        kwargs: dict[str, Any] = {"model_dir": tiny_model_dir, "num_kv_blocks": 128, "dtype": "float32"}
        kwargs["compile_model"] = False
        kwargs.update(overrides)
        engine = LLMEngine(EngineConfig(**kwargs))
        _ENGINES.append(engine)
        return engine

    return factory


def prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    """Random prompts (no special tokens) of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def run_all(
    engine: LLMEngine,
    requests: list[tuple[str, list[int], SamplingParams]],
    max_steps: int = 10_000,
) -> dict[str, list[RequestOutput]]:
    """Add all requests at once and step until done; outputs per request id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid, _, _ in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outs[out.request_id].append(out)
    assert not engine.has_unfinished(), "engine did not finish"
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    """Concatenate the new tokens of a request's outputs."""
    return [t for o in outs for t in o.new_token_ids]


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers generate(do_sample=False), one prompt at a time (no padding)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
