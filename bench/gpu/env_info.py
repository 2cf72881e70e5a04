"""Where a kit run ran: bench.host's block plus GPUs, driver and package versions (no torch
import, so the kit's parent process never holds a CUDA context)."""

from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.host import ROOT, host_info

PACKAGES = ("torch", "triton", "transformers", "grpcio", "protobuf", "fastapi", "llguidance")
# Written by prepare.sh, where the commit is known; run.sh names it in COMMIT_ENV, since the
# GPU host's copy of the tree may hold no .git, or a stale one beside the newer files.
COMMIT_FILE = ROOT / ".gpu-kit" / "commit.txt"
COMMIT_ENV = "MESHSERVE_KIT_COMMIT"


def gpus() -> list[dict[str, str]]:
    """nvidia-smi's name, driver and memory of every GPU (empty without one)."""
    fields = ("name", "driver_version", "memory.total")
    try:
        query = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [
        dict(zip(fields, (v.strip() for v in line.split(",")), strict=False)) for line in query.splitlines()
    ]


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def collect() -> dict[str, Any]:
    """The kit's `env` block."""
    info = host_info()
    if os.environ.get(COMMIT_ENV):
        info["commit"] = os.environ[COMMIT_ENV]
    elif info["commit"] == "unknown" and Path(COMMIT_FILE).exists():
        info["commit"] = COMMIT_FILE.read_text().strip()
    return {**info, "gpus": gpus(), "packages": versions()}
