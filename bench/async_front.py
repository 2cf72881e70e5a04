"""A decode step through the async front (AsyncLLMEngine, c streams consumed in-process, as
the GPU kit's engine rows run) with the forward standing in for a GPU's: it returns at once,
as a launch does, and queues ``--gpu-ms`` of device time behind the steps launched before
it; reading a step's tokens back waits until its device time is over, as reading sampled
tokens off a device does. Per concurrency, the median ms between one stream's tokens:

- ``at_once``: each step's outputs handed to the event loop at once (a CPU forward);
- ``during_forward``: handed over once the next forward is launched (docs/design-decisions.md,
  "Outputs handed over while the GPU runs");
- ``async_scheduling``: the next step scheduled and launched before a step's tokens are read
  back (CUDA's default, design decision "Async scheduling").

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
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench.host import host_info
from bench.host_overhead import build_model
from worker_svc.engine import AsyncLLMEngine, EngineConfig, RequestSpec, SamplingParams

# (runner.launches_async, EngineConfig.async_scheduling) of each mode
MODES = {"at_once": (False, "off"), "during_forward": (True, "off"), "async_scheduling": (True, "on")}


def as_gpu(engine: AsyncLLMEngine, gpu_ms: float) -> None:
    """The forward returns zero logits at once and queues ``gpu_ms`` of device time behind
    the steps before it; a step's tokens are read back once its device time is over."""
    runner, vocab = engine.engine.runner, engine.model_info.vocab_size
    device = {"free_at": 0.0}  # when the device finishes the steps launched so far

    def forward(**kwargs: Any) -> Any:
        device["free_at"] = max(time.perf_counter(), device["free_at"]) + gpu_ms / 1000
        return SimpleNamespace(logits=torch.zeros(1, kwargs["logits_to_keep"].numel(), vocab))

    start_readback = runner.start_readback

    def readback(tokens: torch.Tensor) -> Callable[[], list[int]]:
        done, read = device["free_at"], start_readback(tokens)  # started right after its forward

        def read_when_done() -> list[int]:
            time.sleep(max(0.0, done - time.perf_counter()))
            return read()

        return read_when_done

    runner.model_forward = forward  # type: ignore[method-assign]
    runner.start_readback = readback  # type: ignore[method-assign]


async def step_ms(model_dir: str, c: int, gpu_ms: float, steps: int, mode: str, seed: int) -> float:
    """Median ms between one stream's tokens, c streams decoding together."""
    launches_async, async_scheduling = MODES[mode]
    config = EngineConfig(
        model_dir=model_dir, device="cpu", dtype="float32", compile_model=False, cuda_graphs=False,
        max_num_seqs=c, max_num_batched_tokens=max(512, c), num_kv_blocks=c * 32,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    engine = AsyncLLMEngine(config)
    as_gpu(engine, gpu_ms)
    engine.engine.runner.launches_async = launches_async
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
                for mode in MODES:
                    ms = asyncio.run(step_ms(model, c, gpu_ms, args.steps, mode, seed=r))
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
