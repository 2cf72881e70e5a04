"""A decode step through the async front (AsyncLLMEngine, c streams consumed in-process, as
the GPU kit's engine rows run) with the forward standing in for a GPU's: it returns at once,
as a launch does, and the sampler waits (without the GIL) until ``--gpu-ms`` after it, as
reading sampled tokens off a device does. Per concurrency, the median ms between one
stream's tokens, with each step's outputs handed to the event loop at once (``at_once``: a
CPU forward) and while the next forward runs (``during_forward``: CUDA's default,
docs/design-decisions.md, "Outputs handed over while the GPU runs").

    python -m bench.async_front [--concurrency 1,64,256] [--gpu-ms 1.5,1.5,3] [--steps 150]
        [--rounds 3] [--out bench/results/async_front.json]

The model is the tests' tiny Llama (bench.host_overhead.build_model), so what is timed is
the host's work beside the simulated device time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench.host import host_info
from bench.host_overhead import build_model
from worker_svc.engine import AsyncLLMEngine, EngineConfig, RequestSpec, SamplingParams

MODES = {"at_once": False, "during_forward": True}  # runner.launches_async


def as_gpu(engine: AsyncLLMEngine, gpu_ms: float) -> None:
    """The forward returns zero logits at once; the sampler waits until ``gpu_ms`` after it."""
    runner, vocab, launched = engine.engine.runner, engine.model_info.vocab_size, [0.0]

    def forward(**kwargs: Any) -> Any:
        launched[0] = time.perf_counter()
        return SimpleNamespace(logits=torch.zeros(1, kwargs["logits_to_keep"].numel(), vocab))

    sample = engine.engine.sampler.sample

    def sample_when_done(*args: Any, **kwargs: Any) -> Any:
        time.sleep(max(0.0, launched[0] + gpu_ms / 1000 - time.perf_counter()))
        return sample(*args, **kwargs)

    runner.model_forward = forward  # type: ignore[method-assign]
    engine.engine.sampler.sample = sample_when_done  # type: ignore[method-assign]


async def step_ms(model_dir: str, c: int, gpu_ms: float, steps: int, during: bool, seed: int) -> float:
    """Median ms between one stream's tokens, c streams decoding together."""
    config = EngineConfig(
        model_dir=model_dir, device="cpu", dtype="float32", compile_model=False, cuda_graphs=False,
        max_num_seqs=c, max_num_batched_tokens=max(512, c), num_kv_blocks=c * 32,
    )  # fmt: skip
    engine = AsyncLLMEngine(config)
    as_gpu(engine, gpu_ms)
    engine.engine.runner.launches_async = during
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    times: list[float] = []

    async def stream(i: int) -> None:
        prompt = [rng.randrange(3, 900) for _ in range(64)]
        async for _ in engine.generate(RequestSpec(f"r{i}", prompt, params)):
            if i == 0:
                times.append(time.perf_counter())

    await asyncio.gather(*(stream(i) for i in range(c)))
    await engine.shutdown()
    gaps = [b - a for a, b in itertools.pairwise(times[20:])]  # decode steps only
    return statistics.median(gaps) * 1000


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.async_front", description=__doc__)
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--gpu-ms", default="1.5,1.5,3", help="the device's ms per step, per concurrency")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/async_front.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pairs = list(zip(map(int, args.concurrency.split(",")), map(float, args.gpu_ms.split(",")), strict=True))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "tiny"))
        for c, gpu_ms in pairs:
            row: dict[str, Any] = {"gpu_ms": gpu_ms}
            for r in range(args.rounds):  # modes alternate within each round
                for mode, during in MODES.items():
                    ms = asyncio.run(step_ms(model, c, gpu_ms, args.steps, during, seed=r))
                    row.setdefault(mode, []).append(round(ms, 3))
            for mode in MODES:
                row[f"{mode}_median_ms"] = statistics.median(row[mode])
            results[str(c)] = row
            print(
                f"c={c} device {gpu_ms} ms: "
                + ", ".join(f"{m} {row[f'{m}_median_ms']:.2f} ms" for m in MODES)
            )
    report = {
        "command": "python -m bench.async_front " + " ".join(argv),
        "host": host_info(),
        "config": {"steps": args.steps, "rounds": args.rounds},
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
