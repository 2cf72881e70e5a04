"""lora_bench's workload: the Zipf adapter mix is seeded and skewed, and the summary's
percentiles and throughput come from the requests as recorded."""

from __future__ import annotations

from bench.lora_bench import Result, medians, summary, zipf_choices


def test_zipf_mix_is_seeded_and_skewed() -> None:
    names = [f"lora-{i}" for i in range(8)]
    draws = zipf_choices(names, 2000, 1.1, seed=2)
    assert draws == zipf_choices(names, 2000, 1.1, seed=2)  # every policy gets the same sequence
    counts = [draws.count(n) for n in names]
    assert counts[0] > 2 * counts[3] > 0 and counts == sorted(counts, reverse=True)


def test_summary_percentiles_and_throughput() -> None:
    results = [Result(ttft_s=0.01 * (i + 1), latency_s=1.0, output_tokens=10) for i in range(100)]
    s = summary(results, seconds=4.0)
    assert s["output_tok_s"] == 250.0 and s["requests_s"] == 25.0
    assert s["ttft_p50_ms"] == 505.0 and s["ttft_p99_ms"] == 1000.0


def test_each_figure_is_the_median_of_its_rounds() -> None:
    rounds = [{"output_tok_s": 100.0, "ttft_p50_ms": 9.0}, {"output_tok_s": 300.0, "ttft_p50_ms": 1.0}]
    rounds.append({"output_tok_s": 200.0, "ttft_p50_ms": 5.0})
    m = medians(rounds)
    assert m["output_tok_s"] == 200.0 and m["ttft_p50_ms"] == 5.0 and m["rounds"] == rounds
