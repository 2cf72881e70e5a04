"""Structured-output backends compared: xgrammar vs llguidance (how meshserve picked one).

For a few JSON schemas on a 32k-vocab byte-level BPE tokenizer, measures per backend:
the tokenizer-info setup, each schema's compile time, and the per-step cost of filling
one row's token bitmask while walking a valid JSON instance token by token (fill +
accept, the work the engine does per constrained row per step).

    .venv/bin/python -m bench.grammar_bench --model-dir /tmp/tiny-llama-32k \\
        --out bench/results/grammar_backends.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested_enum_array": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "role": {"enum": ["admin", "editor", "viewer"]},
                        "tags": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["id", "role", "tags"],
                },
                "scores": {"type": "array", "items": {"type": "number"}},
                "active": {"type": "boolean"},
            },
            "required": ["user", "scores", "active"],
        },
        {"user": {"id": 7, "role": "editor", "tags": ["a", "bb"]}, "scores": [1.5, 2], "active": True},
    ),
    "wide_20_fields": (
        {
            "type": "object",
            "properties": {f"field_{i}": {"type": "string", "maxLength": 20} for i in range(20)},
            "required": [f"field_{i}" for i in range(20)],
        },
        {f"field_{i}": f"value {i}" for i in range(20)},
    ),
}


def _xgrammar(tokenizer: Any, vocab: int) -> dict[str, Any]:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start
    out: dict[str, Any] = {"setup_s": setup, "schemas": {}}
    for name, (schema, instance) in SCHEMAS.items():
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
        compile_s = time.perf_counter() - start
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        steps = []
        for tok in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            if not matcher.accept_token(tok):
                raise RuntimeError(f"xgrammar refused a valid instance of {name}")
            steps.append(time.perf_counter() - t0)
        out["schemas"][name] = _summary(compile_s, steps)
    return out


def _llguidance(tokenizer: Any, vocab: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - start
    out: dict[str, Any] = {"setup_s": setup, "schemas": {}}
    for name, (schema, instance) in SCHEMAS.items():
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        matcher = llguidance.LLMatcher(info, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        # llguidance compiles lazily: the first mask pays most of the compile.
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        compile_s = time.perf_counter() - start
        ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        steps = []
        for i, tok in enumerate(ids):
            t0 = time.perf_counter()
            if i:
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            if not matcher.consume_token(tok):
                raise RuntimeError(f"llguidance refused a valid instance of {name}")
            steps.append(time.perf_counter() - t0)
        out["schemas"][name] = _summary(compile_s, steps[1:])
    return out


def _summary(compile_s: float, steps: list[float]) -> dict[str, float]:
    return {
        "compile_ms": round(compile_s * 1e3, 3),
        "step_median_us": round(statistics.median(steps) * 1e6, 1),
        "step_mean_us": round(statistics.fmean(steps) * 1e6, 1),
        "step_p90_us": round(sorted(steps)[int(len(steps) * 0.9)] * 1e6, 1),
        "steps": len(steps),
    }


def main() -> None:
    """Runs both backends and writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    vocab = len(tokenizer)
    result = {"tokenizer": args.model_dir, "vocab": vocab, "threads": 1}
    result["xgrammar"] = _xgrammar(tokenizer, vocab)
    result["llguidance"] = _llguidance(tokenizer, vocab)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
