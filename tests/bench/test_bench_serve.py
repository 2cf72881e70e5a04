"""`bench.serve` against the in-process fake OpenAI SSE server (see conftest.py)."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import pytest
from fake_openai import PROMPT_OVERHEAD, FakeOpenAI

from bench import serve
from bench.serve import RequestResult, arrival_delays, check_target_url, compute_metrics, compute_ratios


def run(fake: FakeOpenAI, tmp_path: Path, args: str, expect_rc: int = 0) -> dict[str, Any]:
    """Run the CLI (`args` split on spaces) against the fake and return the JSON report."""
    out = tmp_path / "result.json"
    argv = [
        "--base-url",
        fake.base_url,
        "--input-len",
        "16",
        "--no-progress",
        "--out",
        str(out),
        *args.split(),
    ]
    assert serve.main(argv) == expect_rc
    return json.loads(out.read_text())


def test_chat_metrics_match_the_fake(fake: FakeOpenAI, tmp_path: Path) -> None:
    """TTFT ≈ first-chunk delay, TPOT/ITL ≈ chunk gap, exact token counts from usage."""
    r = run(fake, tmp_path, "--model fast --num-prompts 8 --max-concurrency 4 --output-len 6")
    assert (r["completed"], r["failed"], r["errors"]) == (8, 0, [])
    assert r["total_output_tokens"] == 8 * 6
    assert r["total_input_tokens"] == 8 * (16 + PROMPT_OVERHEAD)  # usage wins over the estimate
    assert r["max_concurrency_reached"] == 4
    # Lower bounds are physical (the fake sleeps); upper bounds leave room for a loaded CI box
    # (unloaded: TTFT ≈ 55 ms, TPOT ≈ ITL ≈ 10.5 ms).
    assert 49 <= r["p50_ttft_ms"] <= 400 and r["p99_ttft_ms"] >= r["p50_ttft_ms"]
    assert 2 <= r["median_tpot_ms"] <= 60
    assert 2 <= r["median_itl_ms"] <= 60
    assert r["mean_e2e_ms"] >= 50 + 5 * 10
    assert r["output_throughput"] == pytest.approx(48 / r["duration_s"])
    assert r["config"]["model"] == "fast" and r["results"][0]["targets"][0]["completed"] == 8
    body = fake.requests[0]
    assert body["ignore_eos"] is True and body["max_tokens"] == 6 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][-1]["role"] == "user"


def test_completions_without_usage_counts_chunks(fake: FakeOpenAI, tmp_path: Path) -> None:
    """No usage chunk: output tokens fall back to content chunks, input to the word estimate."""
    r = run(
        fake,
        tmp_path,
        "--model nousage --endpoint completions --num-prompts 5 --output-len 7 --num-warmups 2",
    )
    assert (r["completed"], r["failed"]) == (5, 0) and len(fake.requests) == 5 + 2  # warmups: sent, not timed
    assert r["total_output_tokens"] == 35
    assert r["total_input_tokens"] == 5 * 16
    assert all("prompt" in b and "messages" not in b for b in fake.requests)


def test_server_errors_are_counted_not_raised(fake: FakeOpenAI, tmp_path: Path) -> None:
    """HTTP 500s become failed requests with status and message; exit status 1."""
    r = run(fake, tmp_path, "--model fail --num-prompts 6", expect_rc=1)
    assert (r["completed"], r["failed"]) == (0, 6)
    assert r["errors"] == [{"status": 500, "message": "boom", "count": 6}]
    assert r["mean_ttft_ms"] is None and r["request_throughput"] == 0


def test_request_timeout(fake: FakeOpenAI, tmp_path: Path) -> None:
    """A hung stream is cut at --timeout and reported."""
    t0 = time.monotonic()
    r = run(fake, tmp_path, "--model hang --num-prompts 2 --timeout 0.3", expect_rc=1)
    assert time.monotonic() - t0 < 3
    assert r["failed"] == 2 and r["errors"][0]["message"].startswith("timeout after 0.3s")


def test_overall_time_limit(fake: FakeOpenAI, tmp_path: Path) -> None:
    """--max-duration cancels the run; unfinished requests count as failed."""
    t0 = time.monotonic()
    r = run(fake, tmp_path, "--model slow --num-prompts 3 --output-len 100 --max-duration 0.4", expect_rc=1)
    assert time.monotonic() - t0 < 3
    assert r["timed_out"] is True and (r["completed"], r["failed"]) == (0, 3)
    assert "max-duration" in r["errors"][0]["message"]


def test_compare_mode_reports_ratios(
    fake: FakeOpenAI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same workload on two targets; ratios are A / B. Warm-ups keep A's first-connection costs
    out of its timings (a clean CI run once saw A's four TTFTs all above B's)."""
    compare = f"--compare-url {fake.base_url}/v1 --compare-model slow --num-warmups 2"
    r = run(fake, tmp_path, f"--model fast {compare} --num-prompts 4 --max-concurrency 4 --output-len 4")
    a, b = r["results"][0]["targets"]
    assert (a["label"], a["model"], b["label"], b["model"]) == ("A", "fast", "B", "slow")
    ratios = r["ratios"]
    assert ratios["median_ttft_ms"] == pytest.approx(a["median_ttft_ms"] / b["median_ttft_ms"])
    assert ratios["median_ttft_ms"] < 0.7 and ratios["mean_tpot_ms"] < 0.7
    assert ratios["output_throughput"] > 1.3
    prompts_a = [q["messages"] for q in fake.requests if q["model"] == "fast"]
    prompts_b = [q["messages"] for q in fake.requests if q["model"] == "slow"]
    assert sorted(map(json.dumps, prompts_a)) == sorted(map(json.dumps, prompts_b))
    assert "A/B" in capsys.readouterr().out


def test_concurrency_sweep_and_plot(fake: FakeOpenAI, tmp_path: Path) -> None:
    """One result per concurrency point, bounded concurrency, and a PNG plot."""
    png = tmp_path / "sweep.png"
    r = run(
        fake, tmp_path, f"--model quick --num-prompts 6 --output-len 3 --concurrency-sweep 1,3 --plot {png}"
    )
    points = r["results"]
    assert [p["max_concurrency"] for p in points] == [1, 3]
    assert [p["targets"][0]["max_concurrency_reached"] for p in points] == [1, 3]
    assert all(p["targets"][0]["completed"] == 6 for p in points)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_turn_sends_previous_answer(fake: FakeOpenAI, tmp_path: Path) -> None:
    """Turn i+1 carries turn i's exact answer as the assistant message."""
    r = run(fake, tmp_path, "--model quick --dataset multi-turn --num-prompts 3 --num-turns 3 --output-len 4")
    assert (r["completed"], r["failed"], r["total_requests"]) == (9, 0, 9)
    answer_for = {json.dumps(q["messages"]): a for q, a in zip(fake.requests, fake.answers, strict=True)}
    followups = [q for q in fake.requests if len(q["messages"]) > 1]
    assert sorted(len(q["messages"]) for q in fake.requests) == [1] * 3 + [3] * 3 + [5] * 3
    for q in followups:
        msgs = q["messages"]
        assert msgs[-2]["role"] == "assistant"
        assert msgs[-2]["content"] == answer_for[json.dumps(msgs[:-2])]


def test_images_and_poisson_rate(fake: FakeOpenAI, tmp_path: Path) -> None:
    """Image parts are sent as data URLs; a finite --request-rate still completes everything."""
    r = run(
        fake, tmp_path, "--model quick --dataset images --num-prompts 6 --output-len 2 --request-rate 200"
    )
    assert r["completed"] == 6 and r["config"]["request_rate"] == 200
    parts = fake.requests[0]["messages"][0]["content"]
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")


def test_refuses_non_loopback_targets() -> None:
    """Only loopback hosts unless --allow-remote; nothing is sent for a refused URL."""
    for ok in ("http://127.0.0.1:8000", "http://localhost:8000/v1", "http://[::1]:9", "https://127.0.0.5"):
        check_target_url(ok)
    for bad in ("http://example.com", "http://10.1.2.3:8000", "http://0.0.0.0:8000", "ftp://127.0.0.1"):
        with pytest.raises(ValueError):
            check_target_url(bad)
    check_target_url("http://example.com", allow_remote=True)
    with pytest.raises(SystemExit):
        serve.main(
            ["--base-url", "http://127.0.0.1:8000", "--compare-url", "http://192.0.2.1", "--model", "m"]
        )


def test_arrival_offsets() -> None:
    """Poisson offsets: seeded, start at 0, mean gap ≈ 1/rate; inf means all at once."""
    assert arrival_delays(4, math.inf, random.Random(0)) == [0.0] * 4
    a = arrival_delays(2000, 50.0, random.Random(1))
    assert a == arrival_delays(2000, 50.0, random.Random(1))
    assert a[0] == 0.0 and a == sorted(a)
    assert a[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)


def test_compute_metrics_exact() -> None:
    """Aggregation arithmetic on hand-made results."""
    results = [
        RequestResult(ok=True, ttft=0.1, itl=[0.02, 0.04], e2e=0.16, output_tokens=3, prompt_tokens=10),
        RequestResult(ok=True, ttft=0.3, itl=[0.05], e2e=0.35, output_tokens=2, prompt_tokens=20),
        RequestResult(status=503, error="busy"),
    ]
    m = compute_metrics(results, duration=2.0, total=4, percentiles=(50, 99))
    assert (m["completed"], m["failed"]) == (2, 2)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 5)
    assert (
        m["request_throughput"] == 1.0
        and m["output_throughput"] == 2.5
        and m["total_token_throughput"] == 17.5
    )
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["p50_ttft_ms"] == pytest.approx(200)
    assert m["mean_tpot_ms"] == pytest.approx((30 + 50) / 2)
    assert m["mean_itl_ms"] == pytest.approx((20 + 40 + 50) / 3)
    assert m["p99_e2e_ms"] == pytest.approx(160 + 0.99 * 190)
    assert {(e["status"], e["count"]) for e in m["errors"]} == {(503, 1), (None, 1)}
    ratios = compute_ratios(m, {**m, "mean_ttft_ms": 100.0, "output_throughput": 0})
    assert ratios["mean_ttft_ms"] == pytest.approx(2.0) and ratios["output_throughput"] is None


def test_progress_fallback_without_tqdm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without tqdm the progress is a plain stderr counter."""
    monkeypatch.setattr(serve, "_tqdm", None)
    bar = serve.Progress(3, "A", enabled=True)
    bar.update(2)
    bar.update()
    bar.close()
    assert "A: 3/3" in capsys.readouterr().err
