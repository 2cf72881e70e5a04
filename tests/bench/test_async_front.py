"""The async-front bench: steps through AsyncLLMEngine with the forward standing in for a
GPU's take at least the device time it is given, in every mode."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.async_front import MODES, step_ms


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_takes_the_device_time_and_the_host_work(tiny_model_dir: Path, mode: str) -> None:
    ms = asyncio.run(step_ms(str(tiny_model_dir), 3, 4.0, 40, mode, seed=0))
    # Pipelined steps read back 4 ms apart on average: one late wake-up shortens the next gap.
    assert 4.0 * 0.97 <= ms < 40.0
