"""bench.transport_rtt over real loopback: both transports carry messages both ways."""

from __future__ import annotations

import math

from bench.transport_rtt import parse_args, run


def test_both_transports_round_trip_and_are_summarized() -> None:
    report = run(parse_args(["--messages", "5", "--gaps-ms", "0,1", "--repeats", "1"]))
    assert [row["gap_ms"] for row in report["summary"]] == [0.0, 1.0]
    for row in report["summary"]:
        for key in ("grpc_rtt_ms_median", "tcp_rtt_ms_median"):
            assert 0 < row[key] < 1000 and math.isfinite(row[key]), row
    assert {transport: sorted(gaps) for transport, gaps in report["runs"].items()} == {
        "grpc": ["0.0", "1.0"],
        "tcp": ["0.0", "1.0"],
    }
