"""bench.engine_child: an in-process engine in a process of its own, timed there."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bench.engine_bench import Workload
from bench.engine_child import EngineChild
from worker_svc.engine import EngineConfig


def test_a_block_runs_in_the_child_and_comes_back_as_its_ttft(tiny_model_dir: Path) -> None:
    child = EngineChild(
        EngineConfig(model_dir=str(tiny_model_dir), num_kv_blocks=64, dtype="float32"), threads=1
    )
    try:
        assert child._process.pid not in (None, os.getpid())
        workload = Workload([[5, 6, 7, 8], [9, 10, 11]], 3)

        async def blocks() -> list[float]:
            return [await child.run_block(workload, f"salt-{i}", f"b{i}") for i in range(2)]

        ttfts = asyncio.run(blocks())
        assert all(0 < t < 10_000 for t in ttfts)
    finally:
        child.close()
    assert not child._process.is_alive()


def test_a_child_that_cannot_build_its_engine_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="failed to start"):
        EngineChild(EngineConfig(model_dir=str(tmp_path), dtype="float32"))
