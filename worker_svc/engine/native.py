"""The native CPU kernels of ``csrc/`` (paged decode attention, row sampling), built with
the system C compiler into one shared object and loaded through ctypes.

Optional: without a compiler (or when the build fails) :func:`library` returns None and
each caller keeps its torch path. The shared object is cached per sources, flags and CPU
(``-march=native``) under the user's cache directory (``$XDG_CACHE_HOME/meshserve``, by
default ``~/.cache/meshserve``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["DTYPE_CODES", "I64", "PTR", "library"]

log = logging.getLogger(__name__)

# The kernels' calling convention: element dtypes by code (DT_* in csrc/cpu_math.h) and
# the ctypes types of their int64 and pointer arguments.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
I64 = ctypes.c_int64
PTR = ctypes.c_void_p

_CSRC = Path(__file__).with_name("csrc")
# Not -ffast-math: linking a shared object with it pulls in crtfastmath.o, whose constructor
# turns on flush-to-zero / denormals-are-zero for the WHOLE process that loads it (numerics
# elsewhere change; hypothesis refuses to run). No reassociation (-fassociative-math,
# -freciprocal-math) and no implicit FMA contraction either: the bf16 path reproduces the
# flash kernel's float32 operation order exactly (csrc/paged_decode.c); the float32 path's
# reductions still vectorize through `omp simd reduction`.
_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-fopenmp",  # work over torch's OpenMP team (csrc/paged_decode.c)
    "-fPIC",
    "-shared",
    "-std=c11",
)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None when they cannot be built here (logged once)."""
    try:
        return ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("native CPU kernels unavailable, using the torch paths: %s", exc)
        return None


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    sources = sorted(_CSRC.glob("*.c"))
    text = b"".join(p.name.encode() + p.read_bytes() for p in sorted(_CSRC.glob("*.[ch]")))
    key = hashlib.sha256(text + " ".join((compiler, *_FLAGS)).encode() + _cpu_flags()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshserve"
    target = cache_dir / f"meshserve_cpu-{key}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: concurrent builders never see a partial file.
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so")
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, "-o", tmp, *map(str, sources), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _cpu_flags() -> bytes:
    """The CPU's feature flags: ``-march=native`` output is only valid on the same CPU."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
