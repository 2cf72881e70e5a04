"""The engine leaves no OpenMP thread pool behind on the thread that builds it, and
runs its forward at the scheduling class it was given.

libgomp keeps a pool per thread that ran a parallel region, for the thread's life; one
left on the builder's thread beside the engine thread's makes libgomp manage more
threads than CPUs and cut every barrier's spin short, so the engine thread sleeps and is
woken at almost every op (async_engine._build_on_own_thread; docs/design-decisions.md,
"Torch work on one long-lived thread per process"). The checks run in fresh
interpreters, one per module-scoped fixture: a pool made by an earlier test of this
process would hide what they look for.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker_svc.engine import AsyncLLMEngine, EngineConfig

ROOT = Path(__file__).resolve().parents[2]

# Builds an AsyncLLMEngine, then an LLMEngine on the calling thread, and prints after
# each build how many native threads that Python did not start (OpenMP's pool workers)
# the builds have left in the process. The async build comes first: a pool left by the
# caller's build would be counted against it. A KV cache of a few MB makes its zero-fill
# a parallel region.
_PROBE = r"""
import os, sys, threading, time
import torch
torch.set_num_threads(2)
from worker_svc.engine import AsyncLLMEngine, EngineConfig, LLMEngine

def foreign_threads():
    python = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - python

before = foreign_threads()
config = EngineConfig(model_dir=sys.argv[1], num_kv_blocks=4096, dtype="float32", compile_model=False)
engines = []
for where in ("async", "caller"):
    engines.append(LLMEngine(config) if where == "caller" else AsyncLLMEngine(config))
    deadline = time.monotonic() + 10  # a freed pool's threads exit just after the join
    while foreign_threads() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    print(where, len(foreign_threads() - before))
"""


def _run_probe(probe: str, *args: str) -> list[str]:
    """Runs `probe` in a fresh interpreter; the lines it printed."""
    # OpenBLAS (numpy's, scipy's) starts server threads of its own at import: not OpenMP's.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", probe, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return done.stdout.strip().splitlines()


@pytest.fixture(scope="module")
def pool_threads_left(engine_model_dir: str) -> dict[str, int]:
    """Where the engine was built ("async", "caller") -> OpenMP pool threads left."""
    lines = _run_probe(_PROBE, engine_model_dir)
    return {where: int(count) for where, count in (line.split() for line in lines[-2:])}


def test_building_on_the_callers_thread_leaves_a_pool(pool_threads_left: dict[str, int]) -> None:
    """The probe sees the pool a build on the caller's thread leaves (else the next
    test could pass for want of a parallel region in the build)."""
    assert pool_threads_left["caller"] >= 1


def test_async_engine_build_leaves_no_pool(pool_threads_left: dict[str, int]) -> None:
    assert pool_threads_left["async"] == 0


def test_a_failed_build_raises_on_the_callers_thread(tmp_path: Path) -> None:
    """What the builder thread raised reaches the caller, as a build on its own thread would."""
    with pytest.raises(ValueError, match="Unrecognized model"):  # an empty model directory
        AsyncLLMEngine(EngineConfig(model_dir=str(tmp_path), dtype="float32", compile_model=False))


# For each engine_priority given, runs one request through an AsyncLLMEngine (shut down
# before the next) and prints the priority and the scheduling policy (field 41 of
# /proc/<tid>/stat) of: the caller's thread, the engine's step thread, and every thread
# the run started that Python did not (the OpenMP workers of the step thread's forward).
_PRIORITY_PROBE = r"""
import asyncio, os, sys, threading
import torch
torch.set_num_threads(2)
from worker_svc.engine import AsyncLLMEngine, EngineConfig, RequestSpec, SamplingParams

def policy(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[38])

def foreign():
    return {int(t) for t in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()}

async def run(priority):
    before = foreign()
    engine = AsyncLLMEngine(EngineConfig(model_dir=sys.argv[1], dtype="float32", engine_priority=priority, compile_model=False))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    async for _ in engine.generate(RequestSpec("r", list(range(5, 69)), params)):
        pass
    step = next(t for t in threading.enumerate() if t.name == "meshserve-engine")
    workers = sorted(policy(t) for t in foreign() - before)
    print(priority, policy(threading.get_native_id()), policy(step.native_id), ",".join(map(str, workers)))
    await engine.shutdown()

async def main():
    for priority in sys.argv[2:]:
        await run(priority)

asyncio.run(main())
"""

_SCHED_IDLE = 5


@pytest.fixture(scope="module")
def policies(engine_model_dir: str) -> dict[str, tuple[int, int, list[int]]]:
    """engine_priority -> scheduling policies of (caller's thread, step thread, OpenMP workers)."""
    result = {}
    for line in _run_probe(_PRIORITY_PROBE, engine_model_dir, "auto", "normal")[-2:]:
        priority, caller, step, workers = [*line.split(), ""][:4]
        result[priority] = (int(caller), int(step), [int(p) for p in workers.split(",") if p])
    return result


def test_idle_priority_covers_the_forward_and_nothing_else(
    policies: dict[str, tuple[int, int, list[int]]],
) -> None:
    """ "auto" on CPU: the step thread and the OpenMP workers of its forward run at
    SCHED_IDLE (so the relays sharing their CPUs preempt them at once); the caller's
    thread keeps its class."""
    caller, step, workers = policies["auto"]
    assert caller == os.SCHED_OTHER
    assert step == _SCHED_IDLE
    assert workers and set(workers) == {_SCHED_IDLE}, workers


def test_normal_priority_leaves_the_engine_threads_alone(
    policies: dict[str, tuple[int, int, list[int]]],
) -> None:
    caller, step, workers = policies["normal"]
    assert (caller, step) == (os.SCHED_OTHER, os.SCHED_OTHER)
    assert workers and set(workers) == {os.SCHED_OTHER}, workers
