"""The engine leaves no OpenMP thread pool behind on the thread that builds it.

libgomp keeps a pool per thread that ran a parallel region, for the thread's life; one
left on the builder's thread beside the engine thread's makes libgomp manage more
threads than CPUs and cut every barrier's spin short, so the engine thread sleeps and is
woken at almost every op (async_engine._build_on_own_thread; bench/README "Session 17").
Each check runs in a fresh interpreter: a pool made by an earlier test would hide it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker_svc.engine import AsyncLLMEngine, EngineConfig

ROOT = Path(__file__).resolve().parents[2]

# Prints how many native threads that Python did not start (OpenMP's pool workers) the
# build left in the process. A KV cache of a few MB makes its zero-fill a parallel region.
_PROBE = r"""
import os, sys, threading, time
import torch
torch.set_num_threads(2)
from worker_svc.engine import AsyncLLMEngine, EngineConfig, LLMEngine

def foreign_threads():
    python = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - python

before = foreign_threads()
config = EngineConfig(model_dir=sys.argv[1], num_kv_blocks=4096, dtype="float32")
engine = LLMEngine(config) if sys.argv[2] == "caller" else AsyncLLMEngine(config)
deadline = time.monotonic() + 10  # a freed pool's threads exit just after the join
while foreign_threads() - before and time.monotonic() < deadline:
    time.sleep(0.05)
print(len(foreign_threads() - before))
"""


def _pool_threads_left(model_dir: str, where: str) -> int:
    # OpenBLAS (numpy's, scipy's) starts server threads of its own at import: not OpenMP's.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, model_dir, where],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout.strip().splitlines()[-1])


def test_building_on_the_callers_thread_leaves_a_pool(tiny_model_dir: str) -> None:
    """The probe sees the pool a build on the caller's thread leaves (else the next
    test could pass for want of a parallel region in the build)."""
    assert _pool_threads_left(tiny_model_dir, "caller") >= 1


def test_async_engine_build_leaves_no_pool(tiny_model_dir: str) -> None:
    assert _pool_threads_left(tiny_model_dir, "async") == 0


def test_a_failed_build_raises_on_the_callers_thread(tmp_path: Path) -> None:
    """What the builder thread raised reaches the caller, as a build on its own thread would."""
    with pytest.raises(ValueError, match="Unrecognized model"):  # an empty model directory
        AsyncLLMEngine(EngineConfig(model_dir=str(tmp_path), dtype="float32"))
