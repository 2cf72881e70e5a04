"""Writing a benchmark's JSON result: the exact command first, then the results."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def save(module: str, argv: Sequence[str] | None, results: dict[str, Any], out: str) -> dict[str, Any]:
    """Writes `{"command": "python -m <module> <args>", **results}` to `out` (its folder
    created); `argv` None means this process's command line. Returns what was written."""
    args = sys.argv[1:] if argv is None else argv
    report = {"command": f"python -m {module} " + shlex.join(args), **results}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report
