"""The async-front bench: steps through AsyncLLMEngine with the forward standing in for a
GPU's take at least the device time it is given, in both hand-over modes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.async_front import step_ms


@pytest.mark.parametrize("during", [False, True], ids=["at_once", "during_forward"])
def test_a_step_takes_the_device_time_and_the_host_work(tiny_model_dir: Path, during: bool) -> None:
    ms = asyncio.run(step_ms(str(tiny_model_dir), 3, 4.0, 40, during, seed=0))
    assert 4.0 <= ms < 40.0
