"""Loading the native decode kernel must not change the process's floating-point state:
a shared object linked with -ffast-math turns on flush-to-zero for every thread, which
silently changes numerics elsewhere (and makes hypothesis refuse to run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worker_svc.engine import cpu_attention

CHECK = """
import numpy as np
from worker_svc.engine import cpu_attention
tiny = np.float32(1e-40)  # subnormal
assert tiny * np.float32(1.0) != 0, "flush-to-zero before loading"
assert cpu_attention.load() is not None, "kernel did not load"
assert tiny * np.float32(1.0) != 0, "loading the kernel turned on flush-to-zero"
print("ok")
"""


def test_loading_the_kernel_keeps_subnormals() -> None:
    if cpu_attention.load() is None:
        pytest.skip("no C compiler: the native kernel is not built here")
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
