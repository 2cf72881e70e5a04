"""The async-front bench: steps through AsyncLLMEngine with the forward standing in for a
GPU's take at least the device time it is given, in every mode."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.async_front import KIT_DEVICE_MS, KIT_MODES, MODES, kit_row, step_ms
from worker_svc.engine import attention, host_copy, model_runner


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_takes_the_device_time_and_the_host_work(tiny_model_dir: Path, mode: str) -> None:
    ms = asyncio.run(step_ms(str(tiny_model_dir), 3, 4.0, 40, mode, seed=0))
    # Pipelined steps read back 4 ms apart on average: one late wake-up shortens the next gap.
    assert 4.0 * 0.97 <= ms < 40.0


@pytest.mark.parametrize("mode", list(KIT_MODES))
def test_the_kit_row_waits_out_its_device_time(tiny_model_dir: Path, mode: str) -> None:
    """The simulated kit row takes at least the device time its steps queue (by their shape:
    the prompts' tokens and the sampled rows), and a pageable mode's patch is undone."""
    row = asyncio.run(kit_row(str(tiny_model_dir), mode, concurrency=4, requests=8))
    floor, per_row, per_token = KIT_DEVICE_MS
    prompt_ms = 8 * 511 * per_token  # every prompt's tokens but its sampled last one
    steps = 2 * 127  # two waves of 4 (the concurrency), each decoding after its prefill
    assert row["device_busy_s"] * 1000 >= prompt_ms + 8 * 128 * per_row + steps * floor
    assert row["wall_s"] >= row["device_busy_s"] * 0.97
    assert attention.to_device is host_copy.to_device and model_runner.to_device is host_copy.to_device
