"""What every bench result records about where it ran: CPU model, cores, commit, date."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from worker_svc.engine.config import cpu_flags

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The CPU features that decide a CPU host's class: its default dtype and its kernels.
_CLASS_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def class_flags() -> list[str]:
    """Those of `_CLASS_FLAGS` this CPU has (the engine's own reading of /proc/cpuinfo)."""
    present = cpu_flags()
    return [flag for flag in _CLASS_FLAGS if flag in present]


def host_class(flags: list[str]) -> str:
    """The class a CPU result is kept under: `amx` (bf16 on AMX tiles), `avx512-bf16` (bf16
    dot products without AMX), `avx2` (no native bf16: float32), else `other`."""
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    return "avx2" if "avx2" in flags else "other"


def commit() -> str:
    """The checkout's commit, with "+dirty" when the tree has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "")


def host_info() -> dict[str, Any]:
    """The `host` block of a bench result."""
    return {
        "cpu": cpu_model(),
        "cpu_flags": (flags := class_flags()),
        "host_class": host_class(flags),
        "cores": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "loadavg": os.getloadavg(),
    }


def rss_bytes() -> int:
    """This process's resident memory (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
