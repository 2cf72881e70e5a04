"""The worker process starts torch with OpenMP threads that sleep when idle
(OMP_WAIT_POLICY=PASSIVE, worker_svc.__main__), unless its environment says otherwise.

Read back from libgomp itself: OMP_DISPLAY_ENV=VERBOSE makes it print the settings it
took when torch loaded it, GOMP_SPINCOUNT among them (0 = no spinning)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def _spincounts(**env: str) -> set[str]:
    """The GOMP_SPINCOUNT values libgomp reports in `python -m worker_svc --help`."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    child_env.update(OMP_DISPLAY_ENV="VERBOSE", **env)
    result = subprocess.run(
        [sys.executable, "-m", "worker_svc", "--help"],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "usage: worker_svc" in result.stdout
    return set(re.findall(r"GOMP_SPINCOUNT = '(\d+)'", result.stderr))


def test_worker_openmp_threads_do_not_spin_by_default() -> None:
    counts = _spincounts()
    if not counts:
        pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT reported)")
    assert counts == {"0"}


def test_worker_keeps_an_openmp_wait_policy_from_its_environment() -> None:
    counts = _spincounts(OMP_WAIT_POLICY="ACTIVE")
    if not counts:
        pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT reported)")
    assert counts and "0" not in counts
