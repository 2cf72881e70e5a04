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
        [--rounds 3] [--kit-row] [--out bench/results/async_front.json]

``--kit-row`` adds the GPU kit's c=256 row (512 requests, 512-token prompts, 128 tokens out,
8192 tokens per step, closed loop) with device time by step shape, fitted to the kit's H200
figures (`KIT_DEVICE_MS`), throughput and wall time per mode: ``sync`` (async scheduling
off), ``async``, and ``async_pageable``: async with the step's inputs waiting for the device
as a copy from pageable memory does (the engine's eager steps before their inputs went
through page-locked memory; docs/design-decisions.md, "Step inputs in one copy").

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
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from bench.engine_bench import engine_generate_fn, make_workload, run_generate_workload
from bench.host import host_info
from bench.host_overhead import build_model
from worker_svc.engine import (
    AsyncLLMEngine,
    EngineConfig,
    RequestSpec,
    SamplingParams,
    attention,
    model_runner,
)

# (runner.launches_async, EngineConfig.async_scheduling) of each mode
MODES = {"at_once": (False, "off"), "during_forward": (True, "off"), "async_scheduling": (True, "on")}


# The kit's H200 figures (bench/results/gpu.json at 3a27a73, 1.2B profile): ms of a step as
# a floor, per kept (sampled) row and per other token: a c=1 decode step 1.3 ms, c=256 3.5
# ms, a prefill step of 8192 tokens 34 ms.
KIT_DEVICE_MS = (1.3, 0.0086, 0.0041)


def as_gpu(
    engine: AsyncLLMEngine, gpu_ms: float | tuple[float, float, float], patches: ExitStack | None = None
) -> dict[str, float]:
    """The forward returns zero logits at once and queues device time behind the steps
    before it: ``gpu_ms`` per step, or (floor, per kept row, per other token); a step's
    tokens are read back once its device time is over. With ``patches``, until it closes,
    a step's input copies (host_copy.to_device) first wait for the device to finish, as
    pageable ones do. Returns the device's state: when it finishes the steps launched so
    far (``free_at``), and its busy seconds."""
    runner, vocab = engine.engine.runner, engine.model_info.vocab_size
    floor, per_row, per_token = gpu_ms if isinstance(gpu_ms, tuple) else (gpu_ms, 0.0, 0.0)
    device = {"free_at": 0.0, "busy_s": 0.0}

    def forward(**kwargs: Any) -> Any:
        rows, tokens = kwargs["logits_to_keep"].numel(), kwargs["input_ids"].shape[1]
        seconds = (floor + per_row * rows + per_token * (tokens - rows)) / 1000
        device["free_at"] = max(time.perf_counter(), device["free_at"]) + seconds
        device["busy_s"] += seconds
        return SimpleNamespace(logits=torch.zeros(1, rows, vocab))

    for module in (attention, model_runner) if patches is not None else ():
        patches.enter_context(mock.patch.object(module, "to_device", _waiting(module.to_device, device)))

    start_readback = runner.start_readback

    def readback(tokens: torch.Tensor) -> Callable[[], list[int]]:
        done, read = device["free_at"], start_readback(tokens)  # started right after its forward

        def read_when_done() -> list[int]:
            time.sleep(max(0.0, done - time.perf_counter()))
            return read()

        return read_when_done

    runner.model_forward = forward  # type: ignore[method-assign]
    runner.start_readback = readback  # type: ignore[method-assign]
    return device


def _waiting(to_device: Callable[..., Any], device: dict[str, float]) -> Callable[..., Any]:
    """``to_device`` after waiting for ``device`` to finish, as a pageable copy waits
    (sleeping: torch releases the GIL meanwhile)."""

    def wait_then_copy(*args: Any, **kwargs: Any) -> Any:
        time.sleep(max(0.0, device["free_at"] - time.perf_counter()))
        return to_device(*args, **kwargs)

    return wait_then_copy


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


# (EngineConfig.async_scheduling, pageable) of each mode of the kit's row
KIT_MODES = {"sync": ("off", False), "async": ("on", False), "async_pageable": ("on", True)}


async def kit_row(model_dir: str, mode: str, concurrency: int = 256, requests: int = 512) -> dict[str, Any]:
    """The kit's c=256 row on the simulated device: output tok/s, wall and device-busy seconds."""
    async_scheduling, pageable = KIT_MODES[mode]
    config = EngineConfig(
        model_dir=model_dir, device="cpu", dtype="float32", compile_model=False, cuda_graphs=False,
        max_num_seqs=concurrency, max_num_batched_tokens=8192, max_model_len=1024,
        num_kv_blocks=concurrency * (640 // 16 + 4), async_scheduling=async_scheduling,
    )  # fmt: skip
    engine = AsyncLLMEngine(config)
    with ExitStack() as patches:
        device = as_gpu(engine, KIT_DEVICE_MS, patches if pageable else None)
        engine.engine.runner.launches_async = True
        engine.start()
        workload = make_workload(model_dir, requests, 512, 128, seed=concurrency)
        start = time.perf_counter()
        row, _ = await run_generate_workload(engine_generate_fn(engine, mode), workload, concurrency, mode)
        wall = time.perf_counter() - start
        await engine.shutdown()
    return {
        "tok_s": round(row.output_tok_per_s),
        "wall_s": round(wall, 3),
        "device_busy_s": round(device["busy_s"], 3),
    }


def kit_rows(model_dir: str, rounds: int) -> dict[str, Any]:
    """:func:`kit_row` in every mode, ``rounds`` times (modes alternating), with medians."""
    kit: dict[str, Any] = {"device_ms": KIT_DEVICE_MS}
    for _ in range(rounds):
        for mode in KIT_MODES:
            kit.setdefault(mode, []).append(asyncio.run(kit_row(model_dir, mode)))
    for mode in KIT_MODES:
        kit[f"{mode}_median_tok_s"] = statistics.median(r["tok_s"] for r in kit[mode])
    print("kit row: " + ", ".join(f"{m} {kit[f'{m}_median_tok_s']:.0f} tok/s" for m in KIT_MODES))
    return kit


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.async_front", description=__doc__)
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--gpu-ms", default="1.5,1.5,3", help="the device's ms per step, per concurrency")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kit-row", action="store_true", help="also the GPU kit's c=256 row, simulated")
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
        if args.kit_row:
            results["kit_row"] = kit_rows(model, args.rounds)
    report = {
        "command": "python -m bench.async_front " + " ".join(argv),
        "host": host_info(),
        "config": {"steps": args.steps, "rounds": args.rounds},
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
