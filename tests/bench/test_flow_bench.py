"""The benches' rounds (bench.mesh_client.median_of): each figure the median over rounds,
nested figures too, per-request lists left to the rounds."""

from __future__ import annotations

from bench.mesh_client import median_of


def test_each_figure_is_its_median_over_the_rounds() -> None:
    rounds = [
        {
            "alone": {"ttft_p99_ms": 200.0, "requests": 24},
            "beside_flood": {"interactive": {"ttft_p99_ms": 900.0}},
            "longs": [[0.0, 900.0]],
        },
        {
            "alone": {"ttft_p99_ms": 180.0, "requests": 24},
            "beside_flood": {"interactive": {"ttft_p99_ms": 300.0}},
        },
        {
            "alone": {"ttft_p99_ms": 190.0, "requests": 24},
            "beside_flood": {"interactive": {"ttft_p99_ms": 310.0}},
        },
    ]
    assert median_of(rounds) == {
        "alone": {"ttft_p99_ms": 190.0, "requests": 24},
        "beside_flood": {"interactive": {"ttft_p99_ms": 310.0}},  # one bad round moves nothing
    }
