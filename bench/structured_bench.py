"""Per-step cost of structured outputs in the engine: a decode batch of constrained
(JSON schema) requests vs the same batch unconstrained, and a half/half mix.

    .venv/bin/python -m bench.structured_bench --tokenizer-dir /tmp/tiny-llama-32k \\
        --out bench/results/structured.json

The model is a random Llama built from the tokenizer directory's config.json (weights
do not matter for the cost; the 32k vocabulary does). Each row: B requests added at
once, every step timed; decode steps (all B rows sampling, prefill done) are reported.
The schema keeps the matcher busy for the whole run (one string of 1000-2000 characters).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, LlamaForCausalLM

from worker_svc.engine import EngineConfig, LLMEngine, SamplingParams
from worker_svc.engine.structured import StructuredSpec

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 1000, "maxLength": 2000}},
        "required": ["text"],
    }
)


def build_model(tokenizer_dir: Path, out: Path) -> Path:
    """A random-weight Llama with the tokenizer directory's config and tokenizer files."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(tokenizer_dir)).save_pretrained(out)
    return out


def run(engine: LLMEngine, batch: int, constrained: int, steps: int, tag: str) -> list[float]:
    """Decode-step times (s) for ``batch`` requests, ``constrained`` of them with the schema."""
    spec = StructuredSpec("json", SCHEMA)
    for i in range(batch):
        params = SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=steps + 1,
            ignore_eos=True,
            structured=spec if i < constrained else None,
        )
        engine.add_request(f"{tag}-{i}", [5 + i, 40, 41, 42, 43, 44, 45, 46], params)
    times = []
    while engine.has_unfinished():
        running = len(engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if running == batch and all(r.num_output_tokens > 1 for r in engine.scheduler.running):
            times.append(elapsed)
    return times


def main() -> None:
    """Runs the three rows (interleaved repeats) and writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.tokenizer_dir, Path(tmp))
        engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=512, dtype="float32"))
        rows = {"unconstrained": 0, "half_constrained": args.batch // 2, "constrained": args.batch}
        samples: dict[str, list[float]] = {name: [] for name in rows}
        run(engine, args.batch, args.batch, 4, "warmup")  # tokenizer + first compile
        for repeat in range(args.repeats):
            for name, constrained in rows.items():
                samples[name] += run(engine, args.batch, constrained, args.steps, f"{name}{repeat}")
        engine.grammar.close()
    base = statistics.median(samples["unconstrained"])
    result = {
        "tokenizer": str(args.tokenizer_dir),
        "vocab": engine.model_info.vocab_size,
        "batch": args.batch,
        "threads": 1,
        "repeats": args.repeats,
        "rows": {
            name: {
                "step_median_ms": round(statistics.median(t) * 1e3, 3),
                "step_mean_ms": round(statistics.fmean(t) * 1e3, 3),
                "overhead_vs_unconstrained_ms": round((statistics.median(t) - base) * 1e3, 3),
                "steps": len(t),
            }
            for name, t in samples.items()
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
