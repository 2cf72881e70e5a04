"""The one way the tests start a mesh: `running_mesh` (or `start_mesh`) starts the
launcher's `Mesh`, as `make serve` does, on free loopback ports, and hands back a
`RunningMesh`: the mesh plus what tests do with one (kill, restart, read metrics and
loads, wait for decoders to register).

One such mesh (Redis, two scheduler replicas, tokenizer, two decoders, gateway and an
encoder cache) is the session's shared mesh (`shared_mesh`; the root conftest's `shared`
and `mesh` fixtures): every test that asks for it runs on it, and starting a mesh costs
20-90 s on a loaded 2-core machine. Tests that kill or stop a service restart it before
they end, and `RunningMesh.ensure_running` restarts anything a failed test left dead, so
one broken test does not cascade. It stops after the session's last test that uses it.

The shared mesh's model is the tiny untrained test model plus an `<image>` token
(llava-style config keys), so that image inputs go through the real decode path of the
tokenizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.mesh import Mesh, MeshConfig, ServiceSpec, free_ports_config
from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.ports import free_port
from worker_svc.embedding import default_embedding_model_dir

MODEL_NAME = "tiny"
IMAGE_SEQ_LENGTH = 4
# Gateway drain / gRPC drain budget of every service of the shared mesh (seconds).
DRAIN_TIMEOUT_S = 20.0
# Encoder cache capacity of the shared mesh (MiB): small, so oversize puts are cheap to test.
ENCODER_CACHE_MB = 8
API_KEYS = ("sk-reliability-alpha", "sk-reliability-beta")
RATE_LIMIT_RPS = 5.0
RATE_LIMIT_BURST = 10


def build_vlm_model(tiny_model_dir: Path, out: Path) -> Path:
    """A full copy of the tiny model whose tokenizer also has an `<image>` token."""
    from transformers import AutoTokenizer

    if (out / "config.json").is_file():
        return out
    shutil.copytree(tiny_model_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["image_token_index"] = tokenizer.convert_tokens_to_ids("<image>")
    config["image_seq_length"] = IMAGE_SEQ_LENGTH
    (out / "config.json").write_text(json.dumps(config))
    return out


def unlabelled_samples(text: str, prefix: str) -> dict[str, float]:
    """The samples without labels of a /metrics page whose names start with `prefix`, by
    name without it."""
    return {
        sample.name.removeprefix(prefix): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(prefix) and not sample.labels
    }


def metric_value(port: int, name: str, **labels: str) -> float:
    """One sample of the /metrics endpoint on 127.0.0.1:`port` (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def read_rss_kib(pid: int) -> int:
    """Resident set size of a process in KiB (VmRSS of /proc/<pid>/status); 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return 0


class RunningMesh(Mesh):
    """A started launcher `Mesh` plus the helpers the tests use on it."""

    def __init__(self, config: MeshConfig) -> None:
        super().__init__(config)
        self.events: list[str] = []  # what the tests did to it, for failure messages

    # ------------------------------------------------------------------ addresses
    def address(self, name: str) -> str:
        """host:port of a service (`tokenizer`, `scheduler`, `decoder-0`, ...)."""
        return self.specs[name].address

    @property
    def decoders(self) -> list[str]:
        """Names of the decoder worker processes."""
        return sorted(n for n in self.specs if n.startswith("decoder-"))

    def pid(self, name: str) -> int:
        """Process id of a service."""
        return self.procs[name].pid

    def alive(self, name: str) -> bool:
        """True while the service's process runs."""
        return self.procs[name].poll() is None

    # ------------------------------------------------------------------ lifecycle
    def add_service(self, spec: ServiceSpec, timeout: float = 120.0) -> None:
        """Starts an extra process (once) and waits until every service is healthy."""
        if spec.name not in self.procs:
            self.start_service(spec)
        self.wait_healthy(timeout)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to a service process (SIGKILL by default: no cleanup at all)."""
        self.events.append(f"{time.strftime('%X')} signal {sig} -> {name}")
        self.procs[name].send_signal(sig)

    def wait_exit(self, name: str, timeout: float) -> int | None:
        """Waits for a service to exit; its return code, or None if still running."""
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def restart(self, name: str, timeout: float = 120.0) -> float:
        """(Re)starts a stopped service and waits for health; returns seconds taken."""
        start = time.monotonic()
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        self.events.append(f"{time.strftime('%X')} restart {name}")
        self.start_service(self.specs[name])
        self.wait_healthy(timeout)
        return time.monotonic() - start

    def ensure_running(self, timeout: float = 120.0) -> None:
        """Restarts whatever a previous test left dead (Redis included), then `wait_ready`."""
        redis = self.redis
        if redis is not None and not redis.is_running():
            redis.start()
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.events.append(f"{time.strftime('%X')} revive {name}")
                self.start_service(self.specs[name])
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Waits for every service, the gateway's /health (when it runs) and every engine
        worker registered with the scheduler (when it runs: one restarted at the end of
        the previous test may not be yet)."""
        self.wait_healthy(timeout)
        if "gateway" in self.specs:
            wait_gateway_healthy(self.gateway_url, timeout)
        if "scheduler" in self.specs:
            for name in self.engines:
                self.wait_registered(name, timeout)

    @property
    def engines(self) -> list[str]:
        """Names of the decoder and prefill worker processes."""
        return sorted(n for n in self.specs if n.startswith(("decoder-", "prefill-")))

    # ------------------------------------------------------------------ observation
    def rss_kib(self) -> dict[str, int]:
        """VmRSS (KiB) of every running service process."""
        return {name: read_rss_kib(proc.pid) for name, proc in self.procs.items() if proc.poll() is None}

    def rpc_count(self, name: str, method: str, code: str) -> float:
        """`meshserve_rpc_requests_total{method, code}` of a service started with
        MESHSERVE_METRICS_PORT; 0 when never observed."""
        return self.metric(name, "meshserve_rpc_requests_total", method=method, code=code)

    def metric(self, name: str, metric: str, **labels: str) -> float:
        """One sample of a service started with MESHSERVE_METRICS_PORT (the scheduler and
        the decoders are); 0 when never observed."""
        return metric_value(self._metrics_port(name), metric, **labels)

    def _metrics_port(self, name: str) -> int:
        return int(self.specs[name].env["MESHSERVE_METRICS_PORT"])

    def worker_load(self, name: str) -> WorkerLoad:
        """One decoder's load gauges, read from one scrape of its /metrics (as of its
        latest step)."""
        text = httpx.get(f"http://127.0.0.1:{self._metrics_port(name)}/metrics", timeout=5).text
        gauges = unlabelled_samples(text, "meshserve_worker_")
        return WorkerLoad(
            num_running=int(gauges.get("num_running", 0)),
            num_waiting=int(gauges.get("num_waiting", 0)),
            kv_usage=gauges.get("kv_usage", 0.0),
            num_finished=int(gauges.get("num_finished", 0)),
        )

    def wait_kv_idle(self, timeout: float = 20.0, names: list[str] | None = None) -> dict[str, WorkerLoad]:
        """Waits until every decoder (or those `names`) reports nothing running or waiting and every KV block
        free (kv_usage 0; cached-but-unused blocks count as free). Returns the last load
        per decoder; raises on timeout."""
        deadline = time.monotonic() + timeout
        loads: dict[str, WorkerLoad] = {}
        while True:
            loads = {name: self.worker_load(name) for name in (names or self.decoders)}
            if all(load.idle for load in loads.values()):
                return loads
            if time.monotonic() > deadline:
                detail = {n: _load_text(load) for n, load in loads.items()}
                raise AssertionError(f"KV blocks not released after {timeout:.0f}s: {detail}")
            time.sleep(0.2)

    def healthy_decoders(self, max_heartbeat_age_s: float | None = None) -> set[str]:
        """Worker ids the scheduler lists as healthy and not draining (empty if it is down);
        with `max_heartbeat_age_s`, only those heard from that recently."""
        try:
            reply = asyncio.run(_list_workers(self.address("scheduler")))
        except grpc.aio.AioRpcError:
            return set()
        return {
            w.worker.worker_id
            for w in reply.workers
            if w.healthy
            and not w.draining
            and (max_heartbeat_age_s is None or w.last_heartbeat_age_s <= max_heartbeat_age_s)
        }

    def wait_registered(self, name: str, timeout: float = 60.0) -> float:
        """Waits until the scheduler lists decoder `name` healthy with a fresh heartbeat (a
        just-killed worker stays listed healthy until its heartbeats are missed, so a
        stale entry must not count); returns the seconds taken."""
        start = time.monotonic()
        while name not in self.healthy_decoders(max_heartbeat_age_s=1.0) or not self.alive(name):
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{name} not registered with the scheduler after {timeout:.0f}s")
            time.sleep(0.1)
        return time.monotonic() - start

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last lines of a service's log (for assertion messages)."""
        path = self.log_dir / f"{name}.log"
        if not path.is_file():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass(frozen=True)
class WorkerLoad:
    """A decoder's load as its /metrics gauges show it."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_finished: int

    @property
    def idle(self) -> bool:
        return self.num_running == 0 and self.num_waiting == 0 and self.kv_usage == 0.0


def _load_text(load: WorkerLoad) -> str:
    return f"running={load.num_running} waiting={load.num_waiting} kv_usage={load.kv_usage:.3f}"


async def _list_workers(address: str) -> scheduler_pb2.ListWorkersResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        reply: scheduler_pb2.ListWorkersResponse = await stub.ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=2.0
        )
        return reply


def wait_gateway_healthy(url: str, timeout: float = 60.0) -> float:
    """Polls GET /health until 200; returns the seconds it took (raises on timeout)."""
    start = time.monotonic()
    last = ""
    while time.monotonic() - start < timeout:
        try:
            reply = httpx.get(url + "/health", timeout=2.0)
            if reply.status_code == 200:
                return time.monotonic() - start
            last = reply.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health not 200 after {timeout:.0f}s: {last}")


def _free_run(base: int, count: int) -> int:
    """A port from which `count` consecutive ports are free (`base` when it is)."""
    while True:
        try:
            for i in range(count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            base = free_port()


def _replica_ports_free(config: MeshConfig) -> MeshConfig:
    """decoder-i listens on decoder_base_port + i (prefill-i, scheduler replica i alike):
    make sure those ports are free too."""
    return dataclasses.replace(
        config,
        decoder_base_port=_free_run(config.decoder_base_port, config.num_decoders),
        prefill_base_port=_free_run(config.prefill_base_port, config.num_prefill),
        scheduler_port=_free_run(config.scheduler_port, config.num_schedulers),
    )


def mesh_config(base: Path, **options: Any) -> MeshConfig:
    """The launcher's config of a test mesh: `options` over free loopback ports, logs
    under `base`/logs."""
    return _replica_ports_free(free_ports_config(log_dir=str(base / "logs"), **options))


def start_mesh(config: MeshConfig, timeout: float = 180.0) -> RunningMesh:
    """Starts a mesh and waits until it is ready (`RunningMesh.wait_ready`); a start that
    fails stops what it started."""
    mesh = RunningMesh(config)
    started = time.monotonic()
    mesh.start(timeout=timeout)
    try:
        mesh.wait_ready(timeout)
    except BaseException:
        mesh.stop()
        raise
    mesh.events.append(f"mesh started in {time.monotonic() - started:.1f}s (logs in {mesh.log_dir})")
    return mesh


@contextmanager
def running_mesh(base: Path, timeout: float = 180.0, **options: Any) -> Iterator[RunningMesh]:
    """A started mesh of `options` (MeshConfig fields; see `mesh_config`), stopped on exit."""
    mesh = start_mesh(mesh_config(base, **options), timeout)
    try:
        yield mesh
    finally:
        mesh.stop()


def encoder_cache_spec(mesh: Mesh) -> ServiceSpec:
    """The encoder cache (the launcher starts one only with encoders): its own process and port."""
    assert mesh.redis is not None
    port = free_port()
    return ServiceSpec(
        "encoder-cache",
        "encoder_cache_svc",
        port,
        {
            "MESHSERVE_HOST": "127.0.0.1",
            "MESHSERVE_PORT": str(port),
            "MESHSERVE_REDIS_URL": mesh.redis.url,
            "MESHSERVE_CAPACITY_MB": str(ENCODER_CACHE_MB),
            "MESHSERVE_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
            "MESHSERVE_METRICS_PORT": str(free_port()),
        },
    )


_SESSION_MESHES = pytest.StashKey[dict[str, RunningMesh]]()
_LAST_USERS = pytest.StashKey[dict[str, str]]()


def session_mesh(request: pytest.FixtureRequest, mesh: RunningMesh) -> RunningMesh:
    """`mesh`, the value of the session-scoped fixture `request` serves: stopped after the
    session's last test that uses the fixture (`release_after_last_test`), so its
    processes do not idle through the rest of `make test`, or when pytest exits."""
    request.config.stash.setdefault(_SESSION_MESHES, {})[request.fixturename] = mesh
    request.config.add_cleanup(mesh.stop)
    return mesh


def release_after_last_test(item: pytest.Item) -> None:
    """Stops each session mesh whose fixture's last user `item` is (the root conftest's
    `pytest_runtest_teardown` calls it)."""
    meshes = item.config.stash.get(_SESSION_MESHES, {})
    last = item.config.stash.setdefault(_LAST_USERS, {})
    for fixture in list(meshes):
        if fixture not in last:
            users = [i.nodeid for i in item.session.items if fixture in getattr(i, "fixturenames", ())]
            last[fixture] = users[-1] if users else ""
        if item.nodeid == last[fixture]:
            meshes.pop(fixture).stop()


def start_shared_mesh(tiny_model_dir: Path, base: Path) -> RunningMesh:
    """The mesh the reliability, security and fuzz suites share: two decoders of the tiny
    model with an `<image>` token, two scheduler replicas, an encoder cache."""
    mesh = start_mesh(
        mesh_config(
            base,
            model_dir=str(build_vlm_model(tiny_model_dir, base / "tiny-vlm")),
            served_model_name=MODEL_NAME,
            num_decoders=2,
            # Two replicas: the token path does not pass through the scheduler, so killing
            # one (or both) must cost no stream in flight.
            num_schedulers=2,
            # The scheduler's lease counters (the fuzz suite checks its releases there) and the
            # decoders' load gauges (`worker_load`).
            metrics_ports=tuple((name, free_port()) for name in ("scheduler", "decoder-0", "decoder-1")),
            kv_cache_memory_mb=16,
            max_num_seqs=64,
            extra_env=(
                ("MESHSERVE_DEFAULT_MAX_TOKENS", "16"),
                ("MESHSERVE_DRAIN_TIMEOUT_S", str(DRAIN_TIMEOUT_S)),
                ("MESHSERVE_LOG_LEVEL", "INFO"),
            ),
        ),
        timeout=240,
    )
    mesh.add_service(encoder_cache_spec(mesh))
    return mesh


# The e2e mesh's prefill chunk: prompts of the prompt-logprobs tests span several chunks.
E2E_CHUNK = 16


def start_e2e_mesh(model_dir: Path, base: Path) -> RunningMesh:
    """The mesh of the e2e suites that need nothing special: the test model on one
    decoder (prompts prefilled in chunks of `E2E_CHUNK`), the embedding worker, the
    scheduler's metrics. Its own Redis: it runs beside the e2e modules' own meshes,
    whose schedulers would otherwise list its workers (the registry is shared in Redis)."""
    return start_mesh(
        mesh_config(
            base,
            model_dir=str(model_dir),
            num_decoders=1,
            kv_cache_memory_mb=64,
            embedding_model_dir=default_embedding_model_dir(),
            metrics_ports=(("scheduler", free_port()),),
            extra_env=(("MESHSERVE_MAX_NUM_BATCHED_TOKENS", str(E2E_CHUNK)),),
        )
    )


def gateway_spec(handle: RunningMesh, name: str, tokenizer: str = "tokenizer", **env: str) -> ServiceSpec:
    """An extra gateway process on the shared mesh's scheduler (e.g. with API keys)."""
    port = free_port()
    base = {
        "MESHSERVE_HOST": "127.0.0.1",
        "MESHSERVE_PORT": str(port),
        "MESHSERVE_TOKENIZER_ADDRESS": handle.address(tokenizer),
        "MESHSERVE_SCHEDULER_ADDRESS": handle.config.scheduler_addresses,
        "MESHSERVE_DEFAULT_MAX_TOKENS": "16",
        "MESHSERVE_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
    }
    return ServiceSpec(name, "gateway", port, {**base, **env}, grpc=False)


def tokenizer_spec(handle: RunningMesh, name: str, **env: str) -> ServiceSpec:
    """An extra tokenizer process serving the mesh's model (e.g. with other policies)."""
    port = free_port()
    base_env = handle.specs["tokenizer"].env
    return ServiceSpec(name, "tokenizer_svc", port, {**base_env, "MESHSERVE_PORT": str(port), **env})


def chat_body(content: str = "Hello there", max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A small chat completion request for the shared mesh's model."""
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


@dataclass
class StreamResult:
    """What one streaming client saw."""

    status: int = 0
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    seconds: float = 0.0
    first_token_s: float | None = None
    # From the final usage chunk (requests ask for `stream_options.include_usage`).
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        """HTTP 200, a finish reason, `[DONE]` and no error event."""
        return self.status == 200 and self.done and self.finish_reason is not None and self.error is None


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    stop_after_chunks: int | None = None,
    on_first_chunk: asyncio.Event | None = None,
) -> StreamResult:
    """POSTs a streaming chat completion and reads its SSE events.

    `stop_after_chunks` closes the connection after that many content chunks (a client
    disconnect). Transport errors are recorded in `error`, never raised.
    """
    result = StreamResult()
    start = time.monotonic()
    try:
        async with client.stream(
            "POST",
            url + "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
            headers=headers,
        ) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:500]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    result.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    continue
                if event.get("usage"):
                    result.completion_tokens = int(event["usage"]["completion_tokens"])
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        result.text += piece
                        result.chunks += 1
                        if result.first_token_s is None:
                            result.first_token_s = time.monotonic() - start
                            if on_first_chunk is not None:
                                on_first_chunk.set()
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if stop_after_chunks is not None and result.chunks >= stop_after_chunks:
                    break
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.seconds = time.monotonic() - start
    return result


@contextmanager
def timed() -> Iterator[dict[str, float]]:
    """`with timed() as t: ...` then `t["s"]` holds the elapsed seconds."""
    box: dict[str, float] = {}
    start = time.monotonic()
    try:
        yield box
    finally:
        box["s"] = time.monotonic() - start


def fmt_rss(before: dict[str, int], after: dict[str, int]) -> str:
    """One line per process: RSS before -> after (MiB) and the change."""
    lines = []
    for name in sorted(before):
        b, a = before[name] / 1024, after.get(name, 0) / 1024
        lines.append(f"{name}: {b:.1f} -> {a:.1f} MiB ({a - b:+.1f})")
    return "; ".join(lines)


def report(line: str) -> None:
    """Appends a measured result to the file named by MESHSERVE_RELIABILITY_REPORT (if set)
    and prints it (visible with -s), so docs/reliability.md can quote real numbers."""
    print(f"[reliability] {line}", flush=True)
    path = os.environ.get("MESHSERVE_RELIABILITY_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


@dataclass
class LoadResult:
    """Outcome of `run_load`: every request's result plus wall time."""

    results: list[StreamResult]
    seconds: float
    started: int

    @property
    def errors(self) -> list[StreamResult]:
        """Requests that did not end with a finish reason and [DONE]."""
        return [r for r in self.results if not r.ok]

    @property
    def lost(self) -> int:
        """Requests started but never answered at all (no result came back)."""
        return self.started - len(self.results)

    def latency(self, q: float) -> float:
        """Quantile `q` of the end-to-end seconds of the successful requests."""
        times = sorted(r.seconds for r in self.results if r.ok)
        return times[min(len(times) - 1, int(q * len(times)))] if times else math.nan


async def run_load(
    url: str,
    concurrency: int,
    duration_s: float,
    max_tokens: int = 8,
    request_timeout_s: float = 120.0,
) -> LoadResult:
    """`concurrency` clients each send streaming chat requests back to back until
    `duration_s` has passed (each client sends at least one). Prompts vary per client so
    both prefix-cache hits and misses occur."""
    deadline = time.monotonic() + duration_s
    results: list[StreamResult] = []
    started = 0
    limits = httpx.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency + 16)

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        nonlocal started
        turn = 0
        while turn == 0 or time.monotonic() < deadline:
            body = chat_body(
                f"Client {index % 16} asks question {turn}: what is {index}?", max_tokens=max_tokens
            )
            started += 1
            results.append(await stream_chat(client, url, body))
            turn += 1

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(concurrency)))
    return LoadResult(results, time.monotonic() - start, started)
