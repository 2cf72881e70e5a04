"""Multimodal benchmark: TTFT of a repeated-image workload with and without the encoder cache.

    python -m bench.mm_bench [--model-dir DIR] [--requests 48 --images 4 --concurrency 4]
        [--max-tokens 8 --repeats 1] [--out bench/results/multimodal.json]

For each mode a fresh mesh is started (launcher.mesh.Mesh: Redis, gateway, tokenizer,
scheduler, encoder cache, one encoder worker, one decoder worker) and the same seeded
workload is sent through the gateway as streaming chat completions with the images as
data URLs: `--requests` requests cycling over `--images` distinct images, at most
`--concurrency` in flight. Every request has its own `cache_salt`, so the decoder's prefix
cache never helps: the only difference between the modes is the encoder cache.

* ``encoder_cache``: the scheduler checks `EncoderCache.Has` and encodes only misses
  (each image once);
* ``no_encoder_cache``: `MESHSERVE_BYPASS_ENCODER_CACHE=1`, every request runs the
  vision tower again (no cache check, no sharing of in-flight encodes).

Reported per mode: TTFT (first content chunk) p50/p90/mean, end-to-end latency,
throughput, and from the services' /metrics the number of vision-tower runs, encoder
queue time, scheduler encode-call time and encoder cache hits. Without `--model-dir` a
bench-sized LLaVA-style model is built once (devtools.build_vlm: 224 px images, 196
image tokens, an 8-layer 256-wide vision tower, a 4-layer 256-wide text model).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from bench.host import host_info
from bench.mesh_client import free_ports_config
from launcher.mesh import Mesh
from services.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "multimodal.json"
BENCH_MODEL_DIR = ROOT / ".cache" / "models" / "meshserve-mm-bench-vlm"
MODES = {"encoder_cache": (), "no_encoder_cache": (("MESHSERVE_BYPASS_ENCODER_CACHE", "1"),)}
METRIC_SERVICES = ("scheduler", "encoder-cache", "encoder-0")


@dataclass(frozen=True)
class BenchConfig:
    """The workload and the mesh it runs on."""

    model_dir: str
    requests: int = 48
    images: int = 4
    concurrency: int = 4
    max_tokens: int = 8
    image_size: int = 320
    num_threads: int = 1
    repeats: int = 1
    seed: int = 0


@dataclass
class RequestResult:
    ttft: float
    latency: float
    tokens: int


def ensure_model(model_dir: str) -> str:
    """The model to serve: `model_dir`, or the bench VLM (built on first use)."""
    if model_dir:
        return model_dir
    if not (BENCH_MODEL_DIR / "config.json").is_file():
        from devtools.build_vlm import VlmSpec, build

        build(VlmSpec(BENCH_MODEL_DIR, 0, 224, 16, 0.1, 256, 8, 256, 4))
    return str(BENCH_MODEL_DIR)


def data_urls(config: BenchConfig) -> list[str]:
    """`images` distinct random PNG images as data URLs (+ one for warm-up, last)."""
    rng = np.random.default_rng(config.seed)
    urls = []
    for _ in range(config.images + 1):
        pixels = (rng.random((config.image_size, config.image_size, 3)) * 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    return urls


def request_body(model: str, url: str, salt: str, max_tokens: int) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "Describe this picture."},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "cache_salt": salt,
    }


async def send(client: httpx.AsyncClient, base_url: str, body: dict[str, Any]) -> RequestResult:
    """One streaming chat completion; TTFT is the first chunk carrying content."""
    start = time.perf_counter()
    ttft: float | None = None
    chunks = 0
    async with client.stream("POST", base_url + "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("error"):
                raise RuntimeError(event["error"])
            choices = event.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                chunks += 1
                ttft = time.perf_counter() - start if ttft is None else ttft
    if ttft is None:
        raise RuntimeError("stream ended without content")
    return RequestResult(ttft, time.perf_counter() - start, chunks)


async def run_workload(
    base_url: str, model: str, urls: list[str], config: BenchConfig
) -> tuple[list[RequestResult], float]:
    """Sends the workload (request i uses image i % images); returns results and wall time."""
    semaphore = asyncio.Semaphore(config.concurrency)
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(i: int) -> RequestResult:
            async with semaphore:
                body = request_body(model, urls[i % config.images], f"req-{i}", config.max_tokens)
                return await send(client, base_url, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(config.requests)))
    return list(results), time.perf_counter() - start


async def warm_up(base_url: str, model: str, url: str, max_tokens: int) -> None:
    """One untimed request with an image outside the workload (first-call costs)."""
    async with httpx.AsyncClient(timeout=300) as client:
        await send(client, base_url, request_body(model, url, "warmup", max_tokens))


def scrape(mesh: Mesh) -> dict[str, float]:
    """Every sample of the services' /metrics, keyed `service:name{labels}`."""
    samples: dict[str, float] = {}
    for service, port in mesh.config.metrics_ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{service}:{s.name}{{{labels}}}"] = float(s.value)
    return samples


def metric_delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(
    results: list[RequestResult], wall: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    ttft = [r.ttft * 1000 for r in results]
    latency = [r.latency * 1000 for r in results]
    d = lambda key: metric_delta(before, after, key)  # noqa: E731
    queue_n = d("encoder-0:meshserve_encoder_queue_seconds_count{}")
    encode_n = d("scheduler:meshserve_scheduler_encode_seconds_count{}")
    return {
        "requests": len(results),
        "ttft_ms": {
            "p50": percentile(ttft, 0.5),
            "p90": percentile(ttft, 0.9),
            "mean": statistics.fmean(ttft),
        },
        "latency_ms": {"p50": percentile(latency, 0.5), "mean": statistics.fmean(latency)},
        "request_throughput": len(results) / wall,
        "vision_tower_runs": d("encoder-0:meshserve_encoder_items_total{}"),
        "encoder_queue_ms_mean": 1000
        * d("encoder-0:meshserve_encoder_queue_seconds_sum{}")
        / max(queue_n, 1),
        "encode_call_ms_mean": 1000
        * d("scheduler:meshserve_scheduler_encode_seconds_sum{}")
        / max(encode_n, 1),
        "scheduler_cache_lookups": {
            r: d(f"scheduler:meshserve_scheduler_encoder_cache_lookups_total{{result={r}}}")
            for r in ("hit", "miss", "bypass")
        },
        "encoder_cache_get_hits": d("encoder-cache:meshserve_encoder_cache_hits_total{}"),
    }


def run_mode(config: BenchConfig, mode: str, urls: list[str]) -> dict[str, Any]:
    """Starts a mesh for `mode`, runs the workload once, stops the mesh."""
    mesh_config = free_ports_config(
        model_dir=config.model_dir,
        embedding_model_dir="",
        num_encoders=1,
        log_dir=tempfile.mkdtemp(prefix=f"meshserve-mm-bench-{mode}-"),
        kv_cache_memory_mb=64,
        extra_env=(("MESHSERVE_NUM_THREADS", str(config.num_threads)), *MODES[mode]),
        metrics_ports=tuple((name, free_port()) for name in METRIC_SERVICES),
    )
    mesh = Mesh(mesh_config).start(timeout=300)
    try:
        model = httpx.get(mesh.gateway_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(warm_up(mesh.gateway_url, model, urls[-1], config.max_tokens))
        before = scrape(mesh)
        results, wall = asyncio.run(run_workload(mesh.gateway_url, model, urls, config))
        summary = summarize(results, wall, before, scrape(mesh))
    finally:
        mesh.stop()
    print(
        f"{mode:>17}: TTFT p50 {summary['ttft_ms']['p50']:.1f} ms, mean {summary['ttft_ms']['mean']:.1f} ms, "
        f"vision tower runs {summary['vision_tower_runs']:.0f}, {summary['request_throughput']:.2f} req/s",
        flush=True,
    )
    return summary


def median_of(runs: list[dict[str, Any]], path: tuple[str, ...]) -> float:
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value[key]
        values.append(float(value))
    return statistics.median(values)


def compare(results: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Cache vs no cache: TTFT ratios and saved vision-tower runs (medians over repeats)."""
    cached, bypass = results["encoder_cache"], results["no_encoder_cache"]
    out = {}
    for stat in ("p50", "mean"):
        with_cache = median_of(cached, ("ttft_ms", stat))
        without = median_of(bypass, ("ttft_ms", stat))
        out[f"ttft_{stat}_ms_with_cache"] = with_cache
        out[f"ttft_{stat}_ms_without_cache"] = without
        out[f"ttft_{stat}_speedup"] = without / with_cache
    out["vision_tower_runs_with_cache"] = median_of(cached, ("vision_tower_runs",))
    out["vision_tower_runs_without_cache"] = median_of(bypass, ("vision_tower_runs",))
    return out


def parse(argv: Sequence[str]) -> tuple[BenchConfig, Path]:
    parser = argparse.ArgumentParser(prog="python -m bench.mm_bench", description=__doc__.split("\n")[0])
    defaults = BenchConfig(model_dir="")
    parser.add_argument("--model-dir", default="")
    for name in (
        "requests",
        "images",
        "concurrency",
        "max_tokens",
        "image_size",
        "num_threads",
        "repeats",
        "seed",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    return BenchConfig(**args), out


def main(argv: Sequence[str]) -> None:
    config, out = parse(argv)
    config = BenchConfig(**{**asdict(config), "model_dir": ensure_model(config.model_dir)})
    urls = data_urls(config)
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for repeat in range(config.repeats):
        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))  # alternate: the host is noisy
        for mode in order:
            results[mode].append(run_mode(config, mode, urls))
    report = {
        "command": "python -m bench.mm_bench " + " ".join(argv),
        "config": asdict(config),
        "host": host_info(),
        "results": results,
        "comparison": compare(results),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["comparison"], indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
