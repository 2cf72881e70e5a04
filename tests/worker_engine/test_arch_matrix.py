"""Architecture matrix: every family of ``devtools.arch_matrix`` served token for token like
transformers' greedy ``generate`` (fp32, eager attention), built at test time from tiny
random configs.

Per architecture, one scenario covers the engine paths that touch attention: a prompt
longer than the sliding window, prefilled in chunks (token budget 8) while another request
decodes; a second request sharing a 20-token prefix (prefix-cache hit); and both prompts
again on a KV cache too small for them together (preemption and recompute).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from devtools.arch_matrix import CASES, UNSUPPORTED, VOCAB, WINDOW, ArchCase, build_config
from devtools.readme_arch_table import current_section, render_table
from tests.worker_engine.conftest import _ENGINES, hf_greedy, run_all, tokens
from worker_svc.engine import EngineConfig, LLMEngine, SamplingParams, triton_attention
from worker_svc.engine.arch import UnsupportedModelError, attention_spec
from worker_svc.engine.attention import paged_attention_forward

NEW_TOKENS = 6
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
BLOCK = 4
LONG, SHORT, SHARED = 27, 5, 20  # LONG > WINDOW: sliding layers drop its start


def _prompts(vocab: int) -> tuple[list[int], list[int], list[int]]:
    gen = torch.Generator().manual_seed(3)
    long, short, tail = (torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (LONG, SHORT, 3))
    return long, short, long[:SHARED] + tail


def _save(case: ArchCase, path: Path) -> Any:
    """Random weights saved like a checkpoint; returns the reference (eager attention)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(case), dtype=torch.float32)
    sinks = [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
    with torch.no_grad():
        for param in sinks:  # gpt-oss: sinks large enough to change every softmax
            param.normal_(0.0, 2.0)
    model.save_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return ref.eval()


def _engine(path: Path, **overrides: Any) -> LLMEngine:
    kwargs: dict[str, Any] = {
        "model_dir": str(path),
        "block_size": BLOCK,
        "num_kv_blocks": 64,
        "dtype": "float32",
        "compile_model": False,
    }
    engine = LLMEngine(EngineConfig(**{**kwargs, **overrides}))
    _ENGINES.append(engine)  # conftest checks that every block is released
    return engine


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_transformers(case: ArchCase, tmp_path: Path) -> None:
    ref = _save(case, tmp_path)
    long, short, shared = _prompts(int(ref.config.get_text_config().vocab_size))
    expected = {
        name: hf_greedy(ref, p, NEW_TOKENS)
        for name, p in (("long", long), ("short", short), ("shared", shared))
    }

    # Chunked prefill of a prompt longer than the window, next to a decoding request.
    engine = _engine(tmp_path, max_num_batched_tokens=8)
    assert engine.model_info.max_model_len == 256  # the model's limit, not its window
    outs = run_all(engine, [("long", long, PARAMS), ("short", short, PARAMS)])
    assert {k: tokens(v) for k, v in outs.items()} == {"long": expected["long"], "short": expected["short"]}
    assert engine.stats().num_steps > LONG // 8

    # Prefix-cache hit: the shared prefix's full blocks come from the cache.
    out = run_all(engine, [("shared", shared, PARAMS)])["shared"]
    assert out[0].num_cached_tokens == SHARED
    assert tokens(out) == expected["shared"]

    # Preemption: 10 blocks cannot hold long (9 blocks at the end) and short (3) together.
    small = _engine(tmp_path, num_kv_blocks=10, enable_prefix_caching=False)
    outs = run_all(small, [("long", long, PARAMS), ("short", short, PARAMS), ("shared", shared, PARAMS)])
    assert small.stats().num_preemptions > 0
    assert {k: tokens(v) for k, v in outs.items()} == expected


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_merged_projections_match_transformers(case: ArchCase, tmp_path: Path) -> None:
    """CUDA's default, q/k/v and gate/up merged (merge_projections), on every architecture:
    transformers' tokens, chunked beside a decoding request; where the architecture has
    separate q/k/v linears, they stay merged after the load-time check."""
    ref = _save(case, tmp_path)
    long, short, _ = _prompts(int(ref.config.get_text_config().vocab_size))
    expected = {"long": hf_greedy(ref, long, NEW_TOKENS), "short": hf_greedy(ref, short, NEW_TOKENS)}
    engine = _engine(tmp_path, max_num_batched_tokens=8, merge_projections="on")
    outs = run_all(engine, [("long", long, PARAMS), ("short", short, PARAMS)])
    assert {k: tokens(v) for k, v in outs.items()} == expected
    qkv = sum(isinstance(getattr(m, "q_proj", None), torch.nn.Linear) for m in ref.modules())
    assert sum(len(group.sizes) == 3 for group in engine.runner.merged) == qkv  # none unmerged


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.skipif(
    not torch.cuda.is_available() and not triton_attention.interpreting(),
    reason="needs CUDA or TRITON_INTERPRET=1 (test_triton_interpret.py runs it so)",
)
def test_triton_backend_matches_transformers(case: ArchCase, tmp_path: Path) -> None:
    """CUDA's attention (the triton backend: decode kernel, prompt chunks in one launch on
    every layer) and its merged projections, on every architecture: transformers' tokens,
    chunked beside a decoding request, then from a prefix-cache hit."""
    ref = _save(case, tmp_path)
    long, short, shared = _prompts(int(ref.config.get_text_config().vocab_size))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = _engine(
        tmp_path, device=device, attention_backend="triton", merge_projections="on", max_num_batched_tokens=8
    )
    assert engine.model_info.attention_backend == "triton"
    outs = run_all(engine, [("long", long, PARAMS), ("short", short, PARAMS)])
    outs.update(run_all(engine, [("shared", shared, PARAMS)]))
    assert outs["shared"][0].num_cached_tokens == SHARED
    expected = {
        name: hf_greedy(ref, p, NEW_TOKENS)
        for name, p in (("long", long), ("short", short), ("shared", shared))
    }
    assert {k: tokens(v) for k, v in outs.items()} == expected


@pytest.mark.parametrize(("case", "phrase"), UNSUPPORTED, ids=[c.name for c, _ in UNSUPPORTED])
def test_unsupported_attention_is_refused_at_load(case: ArchCase, phrase: str, tmp_path: Path) -> None:
    # config.json only: the refusal must come before any weight is read.
    build_config(case).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as err:
        _engine(tmp_path)
    message = str(err.value)
    assert case.architecture in message and phrase in message, message


def test_window_is_shorter_than_the_prompts() -> None:
    # The matrix only proves windows work if sliding layers really drop tokens.
    assert WINDOW < SHORT + NEW_TOKENS < LONG


@pytest.mark.parametrize("name", ["Gemma 2", "gpt-oss", "Mistral"])
def test_windowed_layers_on_the_torch_backend(name: str, tmp_path: Path) -> None:
    # The matrix runs the default backend (the native CPU decode kernel for full layers);
    # here full layers decode through the torch fallback next to the windowed ones.
    case = next(c for c in CASES if c.name == name)
    ref = _save(case, tmp_path)
    long, short, _ = _prompts(int(ref.config.vocab_size))
    engine = _engine(tmp_path, attention_backend="torch", max_num_batched_tokens=8)
    outs = run_all(engine, [("long", long, PARAMS), ("short", short, PARAMS)])
    assert tokens(outs["long"]) == hf_greedy(ref, long, NEW_TOKENS)
    assert tokens(outs["short"]) == hf_greedy(ref, short, NEW_TOKENS)


def test_max_model_len_is_the_models_limit_bounded_by_the_config(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.name == "Gemma 3")
    _save(case, tmp_path)
    assert _engine(tmp_path, max_model_len=100).model_info.max_model_len == 100
    with pytest.raises(ValueError, match="exceeds the model's limit 256"):
        _engine(tmp_path, max_model_len=257)


def test_gemma3_pattern_gives_interleaved_windows() -> None:
    case = next(c for c in CASES if c.name == "Gemma 3")
    overrides = {k: v for k, v in case.config_kwargs().items() if k != "layer_types"}
    cfg = build_config(
        ArchCase(
            "g3",
            case.config_class,
            case.architecture,
            {**overrides, "num_hidden_layers": 7, "sliding_window_pattern": 3},
            common=False,
        )
    )
    spec = attention_spec(cfg)
    assert spec.layer_windows == (WINDOW, WINDOW, None, WINDOW, WINDOW, None, WINDOW)


@pytest.mark.parametrize(
    ("mask", "kwargs", "message"),
    [
        (None, {"alibi_slopes": torch.ones(2)}, r"cannot honour: \['alibi_slopes'\]"),
        (None, {"is_causal": False}, "non-causal"),
        (torch.zeros(1, 1, 3, 3), {}, "attention mask the model built itself"),
    ],
    ids=["unknown-kwarg", "bidirectional", "own-mask"],
)
def test_attention_the_function_would_ignore_is_an_error(
    mask: torch.Tensor | None, kwargs: dict[str, Any], message: str
) -> None:
    # Anything the paged attention would silently drop stops the forward (and so the load probe).
    module = torch.nn.Module()
    module.layer_idx = 0  # type: ignore[assignment]
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match=message):
        paged_attention_forward(module, q, q, q, mask, **kwargs)


def test_readme_table_matches_the_matrix() -> None:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert current_section(text) == render_table(), "run: python -m devtools.readme_arch_table"
    for case in CASES:
        assert f"`{case.architecture}`" in current_section(text)


_TRITON_HERE = triton_attention.HAS_TRITON and (torch.cuda.is_available() or triton_attention.interpreting())


@pytest.mark.skipif(not _TRITON_HERE, reason="needs triton with CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["gpt-oss", "Gemma 2", "Gemma 3"])
def test_windowed_layers_on_the_triton_backend(name: str, tmp_path: Path) -> None:
    # Triton stores K/V, decodes and attends the prompt chunks of every layer (one launch
    # each), windowed, softcapped or with sinks. Same tokens as the torch backend.
    case = next(c for c in CASES if c.name == name)
    _save(case, tmp_path)
    long, short, _ = _prompts(VOCAB)
    reqs = [("long", long, PARAMS), ("short", short, PARAMS)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = run_all(_engine(tmp_path, device=device, attention_backend="torch", max_num_batched_tokens=8), reqs)
    engine = _engine(tmp_path, device=device, attention_backend="triton", max_num_batched_tokens=8)
    assert engine.model_info.attention_backend == "triton"
    outs = run_all(engine, reqs)
    assert {k: tokens(v) for k, v in outs.items()} == {k: tokens(v) for k, v in ref.items()}


def test_gemma3_vision_checkpoint_is_refused(tmp_path: Path) -> None:
    # Its image tokens attend to each other bidirectionally; the decoder's causal
    # language-model-only load would serve image prompts wrongly. Refused from config.json.
    from transformers import Gemma3Config, SiglipVisionConfig

    text = build_config(next(c for c in CASES if c.name == "Gemma 3"))
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="vision-language model_type 'gemma3'"):
        _engine(tmp_path)


@pytest.mark.slow  # ~15 s of inductor compile per model on a small CPU
@pytest.mark.parametrize("name", ["gpt-oss", "Gemma 2"])
def test_windowed_layers_under_torch_compile(name: str, tmp_path: Path) -> None:
    # The compiled graph calls the paged attention as an opaque custom op that takes the
    # softcap and sinks as arguments and reads the windows from the step's metadata.
    case = next(c for c in CASES if c.name == name)
    ref = _save(case, tmp_path)
    long, short, _ = _prompts(VOCAB)
    engine = _engine(tmp_path, compile_model=True, max_num_batched_tokens=8)
    outs = run_all(engine, [("long", long, PARAMS), ("short", short, PARAMS)])
    assert tokens(outs["long"]) == hf_greedy(ref, long, NEW_TOKENS)
    assert tokens(outs["short"]) == hf_greedy(ref, short, NEW_TOKENS)
    assert engine.runner.compile_seconds > 0


def test_block_size_one_with_a_windowed_model(tmp_path: Path) -> None:
    # The load probe and the window's block skipping at the smallest block size.
    case = next(c for c in CASES if c.name == "gpt-oss")
    ref = _save(case, tmp_path)
    long, _, _ = _prompts(VOCAB)
    engine = _engine(tmp_path, block_size=1, num_kv_blocks=40, max_num_batched_tokens=8)
    assert tokens(run_all(engine, [("long", long, PARAMS)])["long"]) == hf_greedy(ref, long, NEW_TOKENS)
