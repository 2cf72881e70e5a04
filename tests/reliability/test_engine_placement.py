"""The launcher shares the machine between the engines it starts: each decoder of the
shared mesh runs, every thread of it, on CPUs no other decoder has, with as many torch
threads as it has CPUs (issue: two engines on one host oversubscribed its cores)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services import cpus
from tests.mesh import RunningMesh
from worker_svc.engine.config import parse_cpu_list

_STARTED = re.compile(r"(\d+) torch threads, CPUs ([\d,-]+)")


def _thread_cpus(pid: int) -> list[frozenset[int]]:
    """The CPU affinity of every thread of process `pid`."""
    found = []
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found.append(parse_cpu_list(line.split(":", 1)[1].strip()))
    return found


def test_each_decoder_runs_on_cpus_of_its_own_with_a_thread_per_cpu(mesh: RunningMesh) -> None:
    available = cpus.affinity()
    if len(available) < 2:
        pytest.skip("one CPU: two decoders cannot have CPUs of their own")
    placed = {}
    for name in mesh.decoders:
        threads = _thread_cpus(mesh.procs[name].pid)
        assert threads and len(set(threads)) == 1, f"{name}'s threads run on different CPUs: {set(threads)}"
        placed[name] = threads[0]
        log = (mesh.log_dir / f"{name}.log").read_text(errors="replace")
        said = _STARTED.findall(log)
        assert said, f"{name} did not log its threads and CPUs:\n{mesh.log_tail(name)}"
        torch_threads, where = said[-1]  # the latest start (a test may have restarted it)
        assert where == cpus.format_cpus(placed[name])
        assert int(torch_threads) == len(placed[name]), f"{name}: {torch_threads} threads on CPUs {where}"
    first, second = placed.values()
    assert first.isdisjoint(second), placed
    assert len(first) == len(second) == len(available) // 2, placed
