"""Where a kit run ran: GPU, driver, package versions and the commit (no torch import, so
the kit's parent process never holds a CUDA context)."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "triton", "transformers", "grpcio", "protobuf", "fastapi", "llguidance")
# Written by prepare.sh: the GPU host gets a copy of the working tree without .git.
COMMIT_FILE = Path(".gpu-kit/commit.txt")


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def gpus() -> list[dict[str, str]]:
    """nvidia-smi's name, driver and memory of every GPU (empty without one)."""
    fields = ("name", "driver_version", "memory.total")
    query = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
    return [
        dict(zip(fields, (v.strip() for v in line.split(",")), strict=False)) for line in query.splitlines()
    ]


def commit() -> str:
    """The commit of the code that ran (with " (dirty)" for uncommitted changes)."""
    head = _run(["git", "rev-parse", "HEAD"])
    if head:
        return head + (" (dirty)" if _run(["git", "status", "--porcelain", "--untracked-files=no"]) else "")
    return COMMIT_FILE.read_text().strip() if COMMIT_FILE.exists() else "unknown"


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def collect() -> dict[str, Any]:
    return {
        "gpus": gpus(),
        "commit": commit(),
        "python": platform.python_version(),
        "packages": versions(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
