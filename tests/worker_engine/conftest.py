"""Fixtures: a tiny random Llama saved to disk (`engine_model_dir`), engine factories that check
for leaks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from worker_svc.engine import EngineConfig, LLMEngine, RequestOutput, RequestSpec, SamplingParams

VOCAB = 512
EOS = 2


@pytest.fixture(scope="session")
def engine_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The engine tests' model: a seeded random Llama, config and weights only (no tokenizer:
    the tests feed token ids) with peaked logits; hidden 64, 2 layers, 4 heads / 2 kv heads
    (GQA), vocab 512, saved with save_pretrained. Not the services' `tiny_model_dir`
    (tests/conftest.py: devtools.build_model's tiny model, with a tokenizer)."""
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
def hf_model(engine_model_dir: str) -> LlamaForCausalLM:
    """The same weights loaded with stock transformers attention (the reference)."""
    model = LlamaForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32)
    return model.eval()


_ENGINES: list[LLMEngine] = []


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch on one intra-op thread inside: the tiny model gains nothing from parallelism,
    and on a loaded 2-core box OpenMP barriers cost milliseconds/op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_leaked_blocks() -> Iterator[None]:
    """Every engine a test made must end with all KV blocks released; the test runs on
    one torch thread (`_one_torch_thread`)."""
    _ENGINES.clear()
    with _one_torch_thread():
        yield
    engines = list(_ENGINES)
    _ENGINES.clear()
    for engine in engines:
        assert engine.block_manager.num_used_blocks() == 0, "test leaked KV blocks"


def new_engine(model_dir: str, **overrides: Any) -> LLMEngine:
    """An engine of `model_dir`: float32 (the reference's dtype) and eager unless
    overridden, whatever ``dtype="auto"`` and ``compile_model`` default to."""
    kwargs: dict[str, Any] = {"model_dir": model_dir, "num_kv_blocks": 128, "dtype": "float32"}
    kwargs["compile_model"] = False
    kwargs.update(overrides)
    return LLMEngine(EngineConfig(**kwargs))


@pytest.fixture
def make_engine(engine_model_dir: str) -> Callable[..., LLMEngine]:
    """Factory: ``make_engine(**EngineConfig overrides)`` (see `new_engine`)."""

    def factory(**overrides: Any) -> LLMEngine:
        engine = new_engine(overrides.pop("model_dir", engine_model_dir), **overrides)
        _ENGINES.append(engine)
        return engine

    return factory


@dataclass(frozen=True)
class WarmedUp:
    """A compiled engine right after `warm_up`, and what the warm-up did."""

    engine: LLMEngine
    seconds: float
    new_graphs: int
    free_blocks: int
    counts: tuple[int, int, int]  # steps, finished requests, generated tokens


@pytest.fixture(scope="session")
def _warmed_up(engine_model_dir: str) -> WarmedUp:
    engine = new_engine(engine_model_dir, compile_model=True, max_num_batched_tokens=32)
    graphs = counters["stats"]["unique_graphs"]
    # Under the tests' one thread (_no_leaked_blocks; set after this session fixture):
    # dynamo's global-state guard includes torch's thread count, so graphs compiled under
    # another count would compile again on the tests' first step.
    with _one_torch_thread():
        seconds = engine.warm_up()
    return WarmedUp(
        engine,
        seconds,
        counters["stats"]["unique_graphs"] - graphs,
        engine.stats().num_free_blocks,
        (engine.num_steps, engine.num_finished, engine.num_generated_tokens),
    )


@pytest.fixture
def warmed_up(_warmed_up: WarmedUp) -> WarmedUp:
    """One compiled engine of the tiny model, warmed up as the worker does before it
    reports ready, shared by the tests of the compiled forward (each compile takes most
    of a minute on 2 cores); each test using it must leave no KV block in use."""
    _ENGINES.append(_warmed_up.engine)
    return _warmed_up


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
        engine.add_request(RequestSpec(rid, prompt, params))
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
