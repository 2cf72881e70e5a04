"""Full-mesh path for the engine benchmark: the same workload sent through the
gateway's OpenAI `/v1/completions` (token-id prompts, SSE streaming), with every
service running as its own process (launcher.mesh.Mesh) and a real Redis."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from launcher.mesh import Mesh, free_ports_config
from services.log import logged_message


@contextmanager
def running_mesh(
    model_dir: str,
    max_num_seqs: int,
    max_batch_tokens: int,
    extra_env: tuple[tuple[str, str], ...] = (),
    stream_interval: int = 1,
    num_decoders: int = 1,
    num_gateways: int = 1,
) -> Iterator[Mesh]:
    """Starts `num_gateways` gateways (one port), tokenizer, scheduler and `num_decoders`
    decoder workers on free ports."""
    config = free_ports_config(
        model_dir=model_dir,
        max_num_seqs=max_num_seqs,
        stream_interval=stream_interval,
        num_decoders=num_decoders,
        num_gateways=num_gateways,
        log_dir=tempfile.mkdtemp(prefix="meshserve-bench-logs-"),
        extra_env=(("MESHSERVE_MAX_NUM_BATCHED_TOKENS", str(max_batch_tokens)), *extra_env),
    )
    mesh = Mesh(config).start(timeout=300)
    try:
        yield mesh
    finally:
        mesh.stop()


def cpu_seconds(mesh: Mesh, client: bool = False) -> dict[str, float]:
    """CPU time (user + system) used so far by each of the mesh's processes (Linux /proc;
    {} elsewhere); with `client`, this process's (the bench's client) as "client"."""
    result: dict[str, float] = {}
    for name, proc in mesh.procs.items():
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        result[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if client:
        result["client"] = sum(os.times()[:2])
    return result


def median_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over `records` (a bench's rounds) of each number, nested dicts
    likewise; lists (per-request figures) are left out, other values taken from the first
    record."""
    out: dict[str, Any] = {}
    for key, value in records[0].items():
        if isinstance(value, dict):
            out[key] = median_of([r[key] for r in records])
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in records)
        elif not isinstance(value, list):
            out[key] = value
    return out


def completion_body(model: str, prompt: list[int], max_tokens: int, salt: str) -> dict[str, Any]:
    """A streamed, greedy, fixed-length `/v1/completions` body of token ids (usage at the end)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }


def gateway_generate_fn(
    client: httpx.AsyncClient | aiohttp.ClientSession, base_url: str, model: str, salt: str
) -> Callable[[str, list[int], int], AsyncIterator[list[int]]]:
    """A GenerateFn over HTTP: yields one placeholder token per streamed text chunk and
    settles the exact count from the final usage (text chunks are not token ids).

    `client` is an aiohttp session (what `vllm bench serve` uses; its C HTTP parser
    costs the client process about half of httpx's CPU per chunk, and the client shares
    the machine with the system it measures) or an httpx client."""

    async def generate(request_id: str, prompt: list[int], max_tokens: int) -> AsyncIterator[list[int]]:
        body = completion_body(model, prompt, max_tokens, salt)
        seen = 0
        async for event in sse_events(client, base_url + "/v1/completions", body):
            if event.get("usage"):
                rest = event["usage"]["completion_tokens"] - seen
                if rest > 0:
                    yield [0] * rest
                continue
            if any(choice.get("text") for choice in event.get("choices", [])):
                seen += 1
                yield [0]

    return generate


async def sse_lines(
    client: httpx.AsyncClient | aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> AsyncIterator[str]:
    """The lines of a streamed POST response, line ends stripped (HTTP errors raise)."""
    if isinstance(client, httpx.AsyncClient):
        async with client.stream("POST", url, json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                yield line
        return
    async with client.post(url, json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            yield raw.decode().rstrip("\r\n")


async def sse_events(
    client: httpx.AsyncClient | aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """The JSON `data:` events of a streamed POST response, without its `[DONE]`."""
    async for line in sse_lines(client, url, body):
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def model_name(model_dir: str) -> str:
    return Path(model_dir).name


def metric_sample(port: int, name: str, **labels: str) -> float:
    """The sample of a service's /metrics on `port` with exactly `labels` (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def engine_lines(mesh: Mesh) -> dict[str, str]:
    """Each engine worker's start-up line (`engine: dtype ...`): its effective configuration."""
    lines = {}
    for name in mesh.specs:
        if name.startswith(("decoder-", "prefill-")):
            messages = [
                logged_message(line) or "" for line in (mesh.log_dir / f"{name}.log").read_text().splitlines()
            ]
            lines[name] = next((m for m in reversed(messages) if m.startswith("engine: dtype ")), "")
    return lines
