"""Load generator for OpenAI-compatible servers, in the spirit of `vllm bench serve`.

    python -m bench.serve --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
        --endpoint chat --dataset random --num-prompts 200 --max-concurrency 16 --out results.json

Every request streams (SSE, `stream_options.include_usage`) with `ignore_eos: true` and
`max_tokens = output_len` so outputs have a fixed length.  Per request it measures TTFT (time to
the first content chunk), ITL (each gap between content chunks), TPOT ((e2e - ttft) /
(output_tokens - 1)), E2E and output tokens (from the final usage, else the number of content
chunks).  Failures are recorded (status + message) and never abort the run.

`--compare-url` runs the identical workload against a second target afterwards and reports
A/B ratios; `--concurrency-sweep 1,8,32` repeats the run per concurrency and `--plot` draws it.
Only loopback targets are allowed unless `--allow-remote` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.datasets import DATASETS, DatasetConfig, Session, Turn, build_dataset

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # pragma: no cover - tqdm is optional
    _tqdm = None

Message = dict[str, Any]
Metrics = dict[str, Any]

RATIO_KEYS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "mean_e2e_ms",
)
LATENCY_SECTIONS = (
    ("ttft", "Time to First Token"),
    ("tpot", "Time per Output Token (excl. 1st token)"),
    ("itl", "Inter-token Latency"),
    ("e2e", "End-to-end Latency"),
)
MAX_ERROR_SAMPLES = 10
WIDTH = 60


# ---------------------------------------------------------------------------------------------
# Configuration and per-request records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One server under test."""

    label: str
    base_url: str
    model: str
    api_key: str | None = None

    def url(self, endpoint: str) -> str:
        """Full URL of the chat or completions endpoint (base URL with or without `/v1`)."""
        base = self.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return base + ("/chat/completions" if endpoint == "chat" else "/completions")

    def headers(self) -> dict[str, str]:
        """Request headers (bearer token when an API key is set)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class RunConfig:
    """How requests are issued (shared by every target of one invocation)."""

    endpoint: str = "chat"
    max_concurrency: int | None = None
    request_rate: float = math.inf
    timeout: float = 120.0
    max_duration: float | None = 600.0
    seed: int = 0
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    progress: bool = True
    num_warmups: int = 0


@dataclass
class RequestResult:
    """Measurements of one streamed request (times in seconds)."""

    ok: bool = False
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    status: int | None = None
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, or None when undefined."""
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class StreamError(Exception):
    """The server reported an error inside the stream, or the stream carried no content."""


# ---------------------------------------------------------------------------------------------
# Safety: loopback targets only
# ---------------------------------------------------------------------------------------------


def check_target_url(url: str, allow_remote: bool = False) -> None:
    """Raise ValueError unless `url` is http(s) to a loopback host (or `allow_remote`).

    Host names are not resolved (no DNS traffic): only `localhost` and loopback IP literals pass.
    """
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if allow_remote:
        return
    host = parsed.host.lower()
    if host == "localhost" or host.endswith(".localhost"):
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"refusing non-loopback host {host!r} in {url!r} (pass --allow-remote to override)")


# ---------------------------------------------------------------------------------------------
# Request payloads
# ---------------------------------------------------------------------------------------------


def messages_to_prompt(messages: Sequence[Message]) -> str:
    """Flatten chat messages into a completions prompt.

    A single user message (optionally after a system prompt) becomes the raw text; longer
    histories become a `Role: text` transcript ending in `Assistant:`.
    """
    for m in messages:
        if not isinstance(m["content"], str):
            raise ValueError("the completions endpoint takes text only (use --endpoint chat for images)")
    if len(messages) <= 2 and messages[-1]["role"] == "user":
        return "\n\n".join(m["content"] for m in messages)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def build_payload(
    model: str, cfg: RunConfig, session: Session, history: Sequence[Message], turn: Turn
) -> Message:
    """Streaming request body for one turn: history plus the new user message."""
    messages: list[Message] = [{"role": "system", "content": session.system}] if session.system else []
    messages += [*history, {"role": "user", "content": turn.content}]
    body: Message = {
        "model": model,
        "max_tokens": session.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if cfg.endpoint == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = messages_to_prompt(messages)
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    body.update(cfg.extra_body)
    return body


def estimate_tokens(payload: Message) -> int:
    """Prompt size in words (≈ tokens), used when the server reports no usage."""
    if "prompt" in payload:
        return len(str(payload["prompt"]).split())
    total = 0
    for message in payload.get("messages", []):
        content = message.get("content")
        if isinstance(content, str):
            total += len(content.split())
        elif isinstance(content, list):
            total += sum(len(str(p.get("text", "")).split()) for p in content if p.get("type") == "text")
    return total


# ---------------------------------------------------------------------------------------------
# One streamed request
# ---------------------------------------------------------------------------------------------


def error_message(body: bytes) -> str:
    """Best-effort human message from an error response body."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:300]
    return text[:300]


def chunk_text(event: Message, is_chat: bool) -> str:
    """Generated text carried by one stream event (chat delta content or completion text)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if is_chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def consume_stream(resp: httpx.Response, res: RequestResult, start: float, is_chat: bool) -> None:
    """Read an SSE response, filling timings, text and token counts into `res`."""
    parts: list[str] = []
    usage_tokens: int | None = None
    last = start
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        if not data:
            continue
        event = json.loads(data)
        if event.get("error"):
            raise StreamError(error_message(json.dumps(event).encode()))
        usage = event.get("usage")
        if usage:
            usage_tokens = usage.get("completion_tokens", usage_tokens)
            res.prompt_tokens = usage.get("prompt_tokens") or res.prompt_tokens
        piece = chunk_text(event, is_chat)
        if piece:
            now = time.perf_counter()
            if res.ttft is None:
                res.ttft = now - start
            else:
                res.itl.append(now - last)
            last = now
            parts.append(piece)
    res.e2e = time.perf_counter() - start
    res.text = "".join(parts)
    res.output_tokens = usage_tokens if usage_tokens is not None else len(parts)
    if res.ttft is None:
        raise StreamError("stream ended without any content token")
    res.ok = True


async def send_request(
    client: httpx.AsyncClient, target: Target, payload: Message, cfg: RunConfig
) -> RequestResult:
    """POST one streaming request; every failure is captured in the result, never raised."""
    res = RequestResult(prompt_tokens=estimate_tokens(payload))
    start = time.perf_counter()
    try:
        async with asyncio.timeout(cfg.timeout):
            url = target.url(cfg.endpoint)
            async with client.stream("POST", url, json=payload, headers=target.headers()) as resp:
                res.status = resp.status_code
                if resp.status_code != 200:
                    res.error = error_message(await resp.aread())
                else:
                    await consume_stream(resp, res, start, cfg.endpoint == "chat")
    except TimeoutError:
        res.error = f"timeout after {cfg.timeout:g}s"
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if not res.ok:
        res.e2e = time.perf_counter() - start
    return res


# ---------------------------------------------------------------------------------------------
# Running a workload against one target
# ---------------------------------------------------------------------------------------------


class Progress:
    """tqdm progress bar on stderr, or a plain `done/total` counter when tqdm is missing."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        """Create the bar (nothing is drawn when disabled)."""
        self.total, self.desc, self.enabled = total, desc, enabled
        self.done = 0
        self._last_draw = 0.0
        self._bar = _tqdm(total=total, desc=desc, file=sys.stderr, leave=False) if enabled and _tqdm else None

    def update(self, n: int = 1) -> None:
        """Advance by `n` finished requests."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and (self.done >= self.total or time.monotonic() - self._last_draw > 0.25):
            self._last_draw = time.monotonic()
            print(f"\r{self.desc}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def arrival_delays(n: int, rate: float, rng: random.Random) -> list[float]:
    """Offsets (s, from the start) of `n` Poisson arrivals at `rate`/s; all 0 when rate is inf."""
    if math.isinf(rate):
        return [0.0] * n
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


class Runner:
    """Issues one workload against one target and collects per-request results."""

    def __init__(self, target: Target, cfg: RunConfig, client: httpx.AsyncClient, progress: Progress) -> None:
        """Bind the target, config, HTTP client and progress bar."""
        self.target, self.cfg, self.client, self.progress = target, cfg, client, progress
        self.sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.results: list[RequestResult] = []
        self.inflight = 0
        self.max_inflight = 0

    async def request(self, payload: Message) -> RequestResult:
        """Send one request under the concurrency limit, tracking in-flight count."""
        async with self.sem if self.sem is not None else contextlib.nullcontext():
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            try:
                res = await send_request(self.client, self.target, payload, self.cfg)
            finally:
                self.inflight -= 1
        self.results.append(res)
        self.progress.update()
        return res

    async def session(self, session: Session) -> None:
        """Send the turns of one conversation in order, appending each answer to the history."""
        history: list[Message] = []
        for i, turn in enumerate(session.turns):
            res = await self.request(build_payload(self.target.model, self.cfg, session, history, turn))
            if not res.ok:
                skipped = len(session.turns) - i - 1
                self.results.extend(
                    RequestResult(error="skipped: an earlier turn of this conversation failed")
                    for _ in range(skipped)
                )
                self.progress.update(skipped)
                return
            history += [{"role": "user", "content": turn.content}, {"role": "assistant", "content": res.text}]

    async def drive(self, sessions: Sequence[Session], offsets: Sequence[float]) -> None:
        """Start each session at its arrival offset and wait for all; cancel leftovers on exit."""
        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        try:
            for session, offset in zip(sessions, offsets, strict=True):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self.session(session)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def warm_up(
    client: httpx.AsyncClient, target: Target, sessions: Sequence[Session], cfg: RunConfig
) -> None:
    """Send `cfg.num_warmups` untimed first-turn requests (≤ max concurrency at once)."""
    if cfg.num_warmups < 1 or not sessions:
        return
    sem = asyncio.Semaphore(cfg.max_concurrency or cfg.num_warmups)

    async def one(session: Session) -> None:
        async with sem:
            await send_request(
                client, target, build_payload(target.model, cfg, session, [], session.turns[0]), cfg
            )

    await asyncio.gather(*(one(sessions[i % len(sessions)]) for i in range(cfg.num_warmups)))


async def run_target(target: Target, sessions: Sequence[Session], cfg: RunConfig) -> Metrics:
    """Run the whole workload against `target` and return its metrics."""
    total = sum(len(s.turns) for s in sessions)
    pool = cfg.max_concurrency or max(1, total)
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    progress = Progress(total, f"{target.label} c={cfg.max_concurrency or 'inf'}", cfg.progress)
    timed_out = False
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout), limits=limits, trust_env=False
    ) as client:
        await warm_up(client, target, sessions, cfg)
        runner = Runner(target, cfg, client, progress)
        offsets = arrival_delays(len(sessions), cfg.request_rate, random.Random(cfg.seed))
        start = time.perf_counter()
        try:
            async with asyncio.timeout(cfg.max_duration):
                await runner.drive(sessions, offsets)
        except TimeoutError:
            timed_out = True
        duration = time.perf_counter() - start
    progress.close()
    metrics: Metrics = {"label": target.label, "base_url": target.base_url, "model": target.model}
    metrics.update(compute_metrics(runner.results, duration, total, cfg.percentiles))
    metrics.update(max_concurrency=cfg.max_concurrency, max_concurrency_reached=runner.max_inflight)
    metrics["timed_out"] = timed_out
    return metrics


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def latency_stats(name: str, values_ms: Sequence[float], percentiles: Sequence[float]) -> Metrics:
    """mean/std/median and the requested percentiles of one latency series (None when empty)."""
    arr = np.asarray(values_ms, dtype=float)
    empty = arr.size == 0
    out: Metrics = {
        f"mean_{name}_ms": None if empty else float(arr.mean()),
        f"std_{name}_ms": None if empty else float(arr.std()),
        f"median_{name}_ms": None if empty else float(np.median(arr)),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = None if empty else float(np.percentile(arr, p))
    return out


def error_sample(failures: Sequence[RequestResult], missing: int) -> list[Metrics]:
    """The most common (status, message) failures with counts."""
    counts: Counter[tuple[int | None, str]] = Counter((r.status, r.error) for r in failures)
    if missing:
        counts[(None, "not completed: --max-duration reached")] += missing
    return [{"status": s, "message": m, "count": n} for (s, m), n in counts.most_common(MAX_ERROR_SAMPLES)]


def compute_metrics(
    results: Sequence[RequestResult], duration: float, total: int, percentiles: Sequence[float]
) -> Metrics:
    """Aggregate per-request results; requests that never finished count as failed."""
    ok = [r for r in results if r.ok]
    failures = [r for r in results if not r.ok]
    missing = max(0, total - len(results))
    in_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    dur = max(duration, 1e-9)
    metrics: Metrics = {
        "duration_s": duration,
        "total_requests": total,
        "completed": len(ok),
        "failed": len(failures) + missing,
        "errors": error_sample(failures, missing),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / dur,
        "input_throughput": in_tok / dur,
        "output_throughput": out_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
    }
    series = {
        "ttft": [r.ttft * 1000 for r in ok if r.ttft is not None],
        "tpot": [t * 1000 for r in ok if (t := r.tpot) is not None],
        "itl": [gap * 1000 for r in ok for gap in r.itl],
        "e2e": [r.e2e * 1000 for r in ok],
    }
    for name, values in series.items():
        metrics.update(latency_stats(name, values, percentiles))
    return metrics


def compute_ratios(a: Metrics, b: Metrics) -> dict[str, float | None]:
    """Target A / target B for throughput and latency metrics (None when undefined)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        x, y = a.get(key), b.get(key)
        out[key] = x / y if x is not None and y else None
    return out


# ---------------------------------------------------------------------------------------------
# Pretty printing
# ---------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    """Number formatting for the summary tables."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_summary(m: Metrics, percentiles: Sequence[float]) -> str:
    """vLLM-style result block for one target."""
    title = f" Serving Benchmark Result [{m['label']}: {m['model']}] "
    lines = [f"{title:=^{WIDTH}}"]
    rows = [
        ("Successful requests:", m["completed"]),
        ("Failed requests:", m["failed"]),
        ("Maximum request concurrency:", m["max_concurrency"] or "inf"),
        ("Max concurrency reached:", m["max_concurrency_reached"]),
        ("Benchmark duration (s):", m["duration_s"]),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", m["request_throughput"]),
        ("Output token throughput (tok/s):", m["output_throughput"]),
        ("Total Token throughput (tok/s):", m["total_token_throughput"]),
    ]
    lines += [f"{k:<44}{_fmt(v):>16}" for k, v in rows]
    for key, section in LATENCY_SECTIONS:
        lines.append(f"{' ' + section + ' ':-^{WIDTH}}")
        name = key.upper()
        lines.append(f"{'Mean ' + name + ' (ms):':<44}{_fmt(m[f'mean_{key}_ms']):>16}")
        lines.append(f"{'Median ' + name + ' (ms):':<44}{_fmt(m[f'median_{key}_ms']):>16}")
        lines += [
            f"{f'P{p:g} {name} (ms):':<44}{_fmt(m[f'p{p:g}_{key}_ms']):>16}" for p in percentiles if p != 50
        ]
    for err in m["errors"][:3]:
        lines.append(f"error x{err['count']}: [{err['status']}] {err['message'][:WIDTH]}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_comparison(a: Metrics, b: Metrics, ratios: dict[str, float | None]) -> str:
    """Side-by-side table of targets A and B with the A/B ratio."""
    title = f" A ({a['model']}) vs B ({b['model']}) "
    lines = [f"{title:=^{WIDTH}}", f"{'metric':<26}{'A':>12}{'B':>12}{'A/B':>10}"]
    for key in RATIO_KEYS:
        lines.append(f"{key:<26}{_fmt(a.get(key)):>12}{_fmt(b.get(key)):>12}{_fmt(ratios[key], 3):>10}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_sweep(points: Sequence[Metrics]) -> str:
    """One line per (concurrency, target) of a sweep."""
    head = f"{'conc':>6} {'target':>6} {'ok':>6} {'req/s':>9} {'out tok/s':>11} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9}"
    lines = [f"{' Concurrency sweep ':=^{len(head)}}", head]
    for point in points:
        for m in point["targets"]:
            lines.append(
                f"{point['max_concurrency'] or 'inf':>6} {m['label']:>6} {m['completed']:>6} "
                f"{_fmt(m['request_throughput']):>9} {_fmt(m['output_throughput']):>11} "
                f"{_fmt(m.get('median_ttft_ms')):>9} {_fmt(m.get('p99_ttft_ms')):>9} {_fmt(m.get('median_tpot_ms')):>9}"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """Dataset and request-shape options."""
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="requests (conversations for multi-turn)")
    p.add_argument("--input-len", type=int, default=512, help="≈ prompt tokens per request / turn")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (with ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L·[1-r, 1+r]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    p.add_argument(
        "--prefix-len", type=int, default=None, help="shared-prefix: prefix words (default input-len/2)"
    )
    p.add_argument("--num-turns", type=int, default=3, help="multi-turn: user turns per conversation")
    p.add_argument("--image-pool", type=int, default=4, help="images: distinct PNGs")
    p.add_argument("--image-size", type=int, default=64, help="images: PNG side in pixels")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")


def build_parser() -> argparse.ArgumentParser:
    """The `python -m bench.serve` argument parser."""
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--compare-url", default=None, help="second target B, same workload, run after A")
    p.add_argument("--compare-model", default=None, help="model for B (default --model)")
    p.add_argument("--compare-api-key", default=None, help="API key for B (default --api-key)")
    _add_workload_args(p)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--concurrency-sweep", default=None, help="comma-separated, e.g. 1,8,32")
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals/s (inf = all at once)"
    )
    p.add_argument("--num-warmups", type=int, default=0, help="untimed requests per target before each run")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request limit (s)")
    p.add_argument("--max-duration", type=float, default=600.0, help="limit per target run (s); 0 = none")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--plot", default=None, help="PNG of latency and throughput vs concurrency")
    p.add_argument("--allow-remote", action="store_true", help="allow non-loopback targets")
    p.add_argument("--no-progress", action="store_true")
    return p


def _positive_ints(text: str) -> list[int]:
    """Parse `1,8,32` into positive ints."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def validate(args: argparse.Namespace) -> tuple[list[Target], list[int | None]]:
    """Check arguments; return the targets and the concurrency points to run."""
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if not args.request_rate > 0 or args.timeout <= 0:
        raise ValueError("--request-rate and --timeout must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.dataset == "images" and args.endpoint != "chat":
        raise ValueError("--dataset images needs --endpoint chat")
    targets = [Target("A", args.base_url, args.model, args.api_key)]
    if args.compare_url:
        key = args.compare_api_key if args.compare_api_key is not None else args.api_key
        targets.append(Target("B", args.compare_url, args.compare_model or args.model, key))
    for t in targets:
        check_target_url(t.base_url, args.allow_remote)
    sweep: list[int | None] = list(_positive_ints(args.concurrency_sweep)) if args.concurrency_sweep else []
    return targets, sweep or [args.max_concurrency]


def config_record(args: argparse.Namespace, sessions: Sequence[Session]) -> Metrics:
    """JSON-safe copy of the arguments (API keys redacted, inf as a string)."""
    record: Metrics = {}
    for key, value in vars(args).items():
        if key in ("api_key", "compare_api_key"):
            value = "***" if value else None
        elif isinstance(value, float) and math.isinf(value):
            value = "inf"
        record[key] = value
    record["num_sessions"] = len(sessions)
    record["total_requests"] = sum(len(s.turns) for s in sessions)
    return record


def dataset_config(args: argparse.Namespace) -> DatasetConfig:
    """DatasetConfig from the parsed arguments."""
    return DatasetConfig(
        name=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        seed=args.seed,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        num_turns=args.num_turns,
        image_pool=args.image_pool,
        image_size=args.image_size,
    )


def run_config(args: argparse.Namespace) -> RunConfig:
    """RunConfig from the parsed arguments."""
    return RunConfig(
        endpoint=args.endpoint,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        timeout=args.timeout,
        max_duration=args.max_duration or None,
        seed=args.seed,
        temperature=args.temperature,
        extra_body=dict(args.extra_body),
        percentiles=tuple(float(p) for p in args.percentiles.split(",") if p.strip()),
        progress=not args.no_progress,
        num_warmups=max(0, args.num_warmups),
    )


async def run_points(
    targets: Sequence[Target],
    sessions: Sequence[Session],
    cfg: RunConfig,
    concurrencies: Sequence[int | None],
) -> list[Metrics]:
    """Run every target at every concurrency point, sequentially, printing as it goes."""
    points: list[Metrics] = []
    for conc in concurrencies:
        point_cfg = dataclasses.replace(cfg, max_concurrency=conc)
        point: Metrics = {"max_concurrency": conc, "targets": []}
        for target in targets:
            metrics = await run_target(target, sessions, point_cfg)
            print(format_summary(metrics, cfg.percentiles), flush=True)
            point["targets"].append(metrics)
        if len(targets) == 2:
            a, b = point["targets"]
            point["ratios"] = compute_ratios(a, b)
            print(format_comparison(a, b, point["ratios"]), flush=True)
        points.append(point)
    if len(points) > 1:
        print(format_sweep(points), flush=True)
    return points


def build_report(args: argparse.Namespace, sessions: Sequence[Session], points: list[Metrics]) -> Metrics:
    """The JSON document: config + per-point results (+ flat metrics of A for a single point)."""
    report: Metrics = {"config": config_record(args, sessions)}
    if len(points) == 1:
        report.update(points[0]["targets"][0])
        if "ratios" in points[0]:
            report["ratios"] = points[0]["ratios"]
    report["results"] = points
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when every target completed at least one request, else 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        targets, concurrencies = validate(args)
        cfg = run_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    sessions = build_dataset(dataset_config(args))
    total = sum(len(s.turns) for s in sessions)
    for t in targets:
        print(f"target {t.label}: {t.url(cfg.endpoint)} model={t.model}", file=sys.stderr)
    print(f"workload: {args.dataset}, {len(sessions)} sessions / {total} requests", file=sys.stderr)
    points = asyncio.run(run_points(targets, sessions, cfg, concurrencies))
    report = build_report(args, sessions, points)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        from bench.plot import plot_sweep

        plot_sweep(report, args.plot)
    return 0 if all(m["completed"] > 0 for p in points for m in p["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
