"""The models the tests serve, built where missing: the real default model and the
random-weight test models (devtools/build_model.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = ROOT / ".cache" / "models" / "smollm2-135m-instruct"


def default_model() -> Path:
    """The real default model, SmolLM2-135M-Instruct (`make model` builds it; built here if missing)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "devtools.default_model", "--out", str(DEFAULT_MODEL_DIR)],
            check=True,
            cwd=ROOT,
        )
    return DEFAULT_MODEL_DIR


def build_test_model(out: Path, *extra: str) -> Path:
    """A random-weight model built at `out` by devtools.build_model with `extra` flags."""
    subprocess.run(
        [sys.executable, "-m", "devtools.build_model", "--out", str(out), *extra], check=True, cwd=ROOT
    )
    return out
