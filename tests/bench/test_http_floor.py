"""bench.http_floor over real loopback: both servers answer the streamed request, the
runs are summarized per gap, and the report is written with its command."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.http_floor import main, parse_args, run


def test_both_servers_answer_and_are_summarized() -> None:
    report = run(parse_args(["--requests", "3", "--gaps-ms", "0,1", "--repeats", "1"]))
    assert [row["gap_ms"] for row in report["summary"]] == [0.0, 1.0]
    for row in report["summary"]:
        for key in ("raw_ttft_ms_median", "uvicorn_ttft_ms_median"):
            assert 0 < row[key] < 1000 and math.isfinite(row[key]), row
    assert sorted((r["gap_ms"], r["server"]) for r in report["runs"]) == [
        (0.0, "raw"),
        (0.0, "uvicorn"),
        (1.0, "raw"),
        (1.0, "uvicorn"),
    ]


def test_report_names_the_command(tmp_path: Path) -> None:
    out = tmp_path / "new" / "floor.json"
    argv = ["--requests", "2", "--gaps-ms", "0", "--repeats", "1", "--out", str(out)]
    main(argv)
    written = json.loads(out.read_text())
    assert written["command"] == "python -m bench.http_floor " + " ".join(argv)
    assert [row["gap_ms"] for row in written["summary"]] == [0.0]
