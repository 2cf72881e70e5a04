"""What the first forward at a new step size costs: prefills of lengths the engine has not
seen since start, then the same lengths again.

    .venv/bin/python -m bench.first_shape --model-dir /tmp/peer/tiny-llama \\
        --out bench/results/first_shape.json

The engine is the worker's default (dtype auto, compiled, warmed up) unless ``--eager``.
Every prefill has a prompt of its own (no prefix hit) and generates one token, one request
at a time; each round runs the same lengths (``--lengths``, default 125-134) in the same
order. If the first round is slower than the later ones, the cost is per step size (the
token count M of a step), not per request: on CPU, bf16 linears go through oneDNN, which
builds a primitive per input shape and keeps ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` of them
(1024 by default). The JSON records each round's times and the process's RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.host import ROOT, host_info, rss_bytes
from worker_svc.engine import EngineConfig, LLMEngine, RequestSpec, SamplingParams


def _prefill_ms(engine: LLMEngine, length: int, index: int) -> float:
    """One request of ``length`` prompt tokens (its own ids) run to its one token."""
    vocab = engine.model_info.vocab_size
    ids = [(7 * i + 31 * index) % (vocab - 10) + 5 for i in range(length)]
    engine.add_request(
        RequestSpec(f"p{index}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    )
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) * 1000


def _first_over_later(rounds: list[dict]) -> float | None:
    """The first round's median prefill over the median of the later rounds' medians."""
    if len(rounds) < 2:
        return None
    return round(rounds[0]["median_ms"] / statistics.median(r["median_ms"] for r in rounds[1:]), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--lengths", default="125-134", help="a range LO-HI of prompt lengths")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="compile off")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/first_shape.json")
    args = parser.parse_args(argv)
    lo, hi = (int(x) for x in args.lengths.split("-"))
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model_dir=args.model_dir, compile_model=not args.eager))
    engine.warm_up()
    rounds, count = [], 0
    for _ in range(args.rounds):
        times = []
        for length in range(lo, hi + 1):
            count += 1
            times.append(round(_prefill_ms(engine, length, count), 2))
        rounds.append(
            {"prefill_ms": times, "median_ms": statistics.median(times), "rss_mib": rss_bytes() / 2**20}
        )
        print(f"round {len(rounds)}: median {rounds[-1]['median_ms']:.1f} ms", flush=True)
    report = {
        "command": "python -m bench.first_shape " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": host_info(),
        "engine": engine.describe(),
        "onednn_primitive_cache_capacity": os.environ.get(
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "default (1024)"
        ),
        "lengths": list(range(lo, hi + 1)),
        "rounds": rounds,
        "first_over_later": _first_over_later(rounds),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"first_over_later": report["first_over_later"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
