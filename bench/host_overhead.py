"""Host work per engine step, the forward excluded: what the engine's own Python costs a GPU
step (scheduler, block manager, input preparation, attention metadata, sampler, outputs),
measured on any host with the model's forward replaced by one that returns at once.

    python -m bench.host_overhead [--concurrency 1,64,256] [--steps 200] [--rounds 3]
        [--prompt-tokens 128] [--repetition-penalty 1.0] [--frequency-penalty 0.0]
        [--profile-at 256] [--out bench/results/host_overhead.json]

The model is the tests' tiny Llama (devtools.build_model --tiny: vocab 1000), so the
sampler's arithmetic is negligible and what is timed is host work. Per concurrency c: c
requests with random `--prompt-tokens`-token prompts, greedy (penalized where asked),
ignore_eos, are admitted and prefilled; then `--steps` decode steps of all c rows are timed
one by one (LLMEngine.step); per round the median and mean ms per step; the JSON has every
round and their medians.
Each concurrency runs twice: decode steps eager (``results``) and through the decode graphs'
static buffers (``graphs``: CUDA's decode path, with a capture that calls the stubbed
forward again, so the graphs' per-step fill is timed and no device is needed).
`--profile-at C` adds cProfile's top functions of the graph steps at that concurrency.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench.host import ROOT, host_info
from worker_svc.engine import EngineConfig, LLMEngine, RequestSpec, SamplingParams
from worker_svc.engine.cuda_graphs import capture_graphs

# The sampling penalties of the flags' defaults: none (for callers that build the arguments).
NO_PENALTIES = {"repetition_penalty": 1.0, "frequency_penalty": 0.0}
# Penalties of a penalized run: Qwen2.5's default repetition penalty, and a frequency penalty.
PENALIZED = {"repetition_penalty": 1.05, "frequency_penalty": 0.1}


def build_model(out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "devtools.build_model", "--tiny", "--out", str(out)],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    return out


def stub_forward(engine: LLMEngine) -> None:
    """The model's forward returns zero logits for the kept rows at once, on the engine's
    device (on a GPU the sampler's argmax and its copy back stay in the timed step)."""
    vocab = engine.model_info.vocab_size
    dtype = getattr(torch, engine.model_info.dtype)
    device = engine.runner.device

    def forward(**kwargs: Any) -> Any:
        rows = (
            kwargs["logits_to_keep"].numel() if "logits_to_keep" in kwargs else kwargs["input_ids"].shape[1]
        )
        return SimpleNamespace(logits=torch.zeros(1, rows, vocab, dtype=dtype, device=device))

    engine.runner.model_forward = forward  # type: ignore[method-assign]


def _max_tokens(concurrency: int, args: argparse.Namespace, budget: int) -> int:
    """Enough that no request ends before the timed steps do: the first prompts decode
    while the last ones prefill, ``budget`` tokens (a step's) at a time."""
    prefill_steps = -(-concurrency * args.prompt_tokens // budget)
    return args.steps + 64 + prefill_steps


def decode_steps(engine: LLMEngine, concurrency: int, args: argparse.Namespace, seed: int) -> list[float]:
    """Admits `concurrency` requests, prefills them, then times `args.steps` decode steps (s each)."""
    rng = random.Random(seed)
    vocab = engine.model_info.vocab_size
    params = SamplingParams(
        temperature=0.0,
        max_tokens=_max_tokens(concurrency, args, engine.config.max_num_batched_tokens),
        ignore_eos=True,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    for i in range(concurrency):
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
        engine.add_request(RequestSpec(f"s{seed}-r{i}", prompt, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()  # every row decodes from here on
    if len(engine.scheduler.running) != concurrency:
        raise RuntimeError(
            f"{len(engine.scheduler.running)} of {concurrency} requests decode: the cache is too small"
        )
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished():
        engine.step()
    return times


def profile_steps(engine: LLMEngine, concurrency: int, args: argparse.Namespace) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    decode_steps(engine, concurrency, args, seed=10_000)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def measure(
    model_dir: str, device: str, concurrencies: Sequence[int], args: argparse.Namespace, graphs: bool = False
) -> dict[str, Any]:
    """Median host ms per decode step at each concurrency (``args``: steps, rounds,
    prompt_tokens, profile_at), on ``device``, decode steps eager or through the decode
    graphs' buffers (``graphs``: captured as the stubbed forward itself, which a replay
    calls again); with cProfile's top functions when ``args.profile_at`` is set."""
    c, budget = max(concurrencies), max(2048, max(concurrencies))
    tokens = args.prompt_tokens + _max_tokens(c, args, budget)  # the longest sequence
    config = EngineConfig(
        model_dir=model_dir, device=device, dtype="float32", compile_model=False, cuda_graphs=False,
        max_num_seqs=c, max_num_batched_tokens=budget, num_kv_blocks=c * (tokens // 16 + 2),
        attention_backend="cpu" if graphs and device == "cpu" else "auto",
    )  # fmt: skip
    engine = LLMEngine(config)
    stub_forward(engine)
    if graphs and capture_graphs(engine.runner, lambda forward: forward)[0] is None:
        raise RuntimeError("the decode graphs' buffers could not be attached")
    results: dict[str, Any] = {}
    for c in concurrencies:
        rounds = []
        for r in range(args.rounds):
            times = decode_steps(engine, c, args, seed=r)
            rounds.append(
                {"median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.mean(times) * 1e3}
            )
        results[str(c)] = {"rounds": rounds, "median_ms": statistics.median(x["median_ms"] for x in rounds)}
    if args.profile_at:
        results["profile"] = profile_steps(engine, args.profile_at, args)
    return results


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__)
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    for name, none in NO_PENALTIES.items():
        parser.add_argument(
            "--" + name.replace("_", "-"), type=float, default=none, help=f"every request's ({none}: none)"
        )
    parser.add_argument("--profile-at", type=int, default=0, help="cProfile the steps at this concurrency")
    parser.add_argument("--out", default="bench/results/host_overhead.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "tiny"))
        eager = measure(model, "cpu", concurrencies, argparse.Namespace(**{**vars(args), "profile_at": 0}))
        graphs = measure(model, "cpu", concurrencies, args, graphs=True)
    profile = graphs.pop("profile", "")
    for c in eager:
        print(
            f"c={c}: {eager[c]['median_ms']:.3f} ms per step eager, {graphs[c]['median_ms']:.3f} through graphs"
        )
    report = {
        "command": "python -m bench.host_overhead " + " ".join(argv),
        "host": host_info(),
        "config": {
            k: getattr(args, k)
            for k in ("steps", "rounds", "prompt_tokens", "repetition_penalty", "frequency_penalty")
        },
        "results": eager,
        "graphs": graphs,
        "targets_ms": {"1": 0.5, "64": 1.0, "256": 2.0},
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if profile:
        print(profile)


if __name__ == "__main__":
    main(sys.argv[1:])
