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

from devtools.arch_matrix import CASES, UNSUPPORTED, WINDOW, ArchCase, build_config
from tests.worker_engine.conftest import _ENGINES, hf_greedy, run_all, tokens
from worker_svc.engine import EngineConfig, LLMEngine, SamplingParams
from worker_svc.engine.arch import UnsupportedModelError

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
    kwargs: dict[str, Any] = {"model_dir": str(path), "block_size": BLOCK, "num_kv_blocks": 64, "dtype": "float32"}
    engine = LLMEngine(EngineConfig(**{**kwargs, **overrides}))
    _ENGINES.append(engine)  # conftest checks that every block is released
    return engine


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_transformers(case: ArchCase, tmp_path: Path) -> None:
    ref = _save(case, tmp_path)
    long, short, shared = _prompts(int(ref.config.get_text_config().vocab_size))
    expected = {name: hf_greedy(ref, p, NEW_TOKENS) for name, p in (("long", long), ("short", short), ("shared", shared))}

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


@pytest.mark.parametrize(("case", "phrase"), UNSUPPORTED, ids=[c.name for c, _ in UNSUPPORTED])
def test_unsupported_attention_is_refused_at_load(case: ArchCase, phrase: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config(case)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as err:
        _engine(tmp_path)
    message = str(err.value)
    assert case.architecture in message and phrase in message, message


def test_window_is_shorter_than_the_prompts() -> None:
    # The matrix only proves windows work if sliding layers really drop tokens.
    assert WINDOW < SHORT + NEW_TOKENS < LONG
