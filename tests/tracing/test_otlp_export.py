"""OTLP export end to end, against a real OTLP/gRPC receiver (tests/tracing/otlp_receiver.py).

- A real tokenizer process with `--tracing otlp`: its server span for a call made with a
  parent trace context in metadata is batched (nothing exported while it serves), then
  exported when it drains on SIGTERM, with the caller's trace as parent.
- The `trace_context` map of a GenerateRequest carries a trace across the wire:
  `inject_into` on one side, `span_from` on the other, spans exported over OTLP.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from meshserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services import tracing
from services.ports import free_port
from services.rpc import check_health
from tests.tracing.otlp_receiver import SpanRecord, otlp_receiver, otlp_tracing

ROOT = Path(__file__).resolve().parents[2]
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
# The process imports torch/transformers: slow on a loaded machine, so only start-up
# gets a long bound; every span check is bounded by a few seconds.
STARTUP_TIMEOUT_S = 90.0


async def _start_tokenizer(model_dir: Path, port: int, endpoint: str) -> asyncio.subprocess.Process:
    env = {
        **os.environ,
        # The periodic export must not fire during the test: only the stop path may export.
        "OTEL_BSP_SCHEDULE_DELAY": "600000",
        "MESHSERVE_DRAIN_TIMEOUT_S": "1",
    }
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenizer_svc",
        "--port",
        str(port),
        "--model-dir",
        str(model_dir),
        "--tracing",
        "otlp",
        "--otlp-endpoint",
        endpoint,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def _until_serving(process: asyncio.subprocess.Process, address: str) -> None:
    async def poll() -> None:
        while not await check_health(address):
            if process.returncode is not None:
                raise RuntimeError(f"tokenizer exited with {process.returncode} at start")
            await asyncio.sleep(0.2)

    await asyncio.wait_for(poll(), STARTUP_TIMEOUT_S)


class LogWatch:
    """Reads a process's stderr as it comes (so the pipe never fills up) and tells when
    a line containing some text was logged."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while raw := await stream.readline():
            self.lines.append(raw.decode(errors="replace"))
            self._changed.set()
        self._changed.set()

    async def logged(self, text: str, timeout_s: float) -> None:
        """Returns once a line containing `text` was read; TimeoutError otherwise."""

        async def scan() -> None:
            while not any(text in line for line in self.lines):
                if self._task.done():
                    raise EOFError(f"{text!r} never logged:\n" + "".join(self.lines))
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(scan(), timeout_s)


@pytest.fixture
async def stopped_process() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Kills the test's processes if a failed assertion left them running."""
    processes: list[asyncio.subprocess.Process] = []
    yield processes
    for process in processes:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.timeout(STARTUP_TIMEOUT_S + 30)
async def test_service_exports_its_server_span_when_it_stops(
    model_dir: Path, stopped_process: list[asyncio.subprocess.Process]
) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    async with otlp_receiver() as rx:
        port = free_port()
        process = await _start_tokenizer(model_dir, port, rx.endpoint)
        stopped_process.append(process)
        assert process.stderr is not None
        log = LogWatch(process.stderr)
        await _until_serving(process, f"127.0.0.1:{port}")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            await stub.Tokenize(
                tokenizer_pb2.TokenizeRequest(model=model_dir.name, text="hello"),
                metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")],
                timeout=10,
            )
        await asyncio.sleep(0.3)
        assert rx.spans() == [], "spans must be batched, not exported one by one"
        process.send_signal(signal.SIGTERM)
        await log.logged("tokenizer stopped", timeout_s=15)
        # The drain exports before it logs "stopped": the span is here before exit handlers.
        exported = [s for s in rx.spans() if s.trace_id == trace_id]
        assert exported, "no span of the caller's trace exported by the drain:\n" + "".join(log.lines)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    (server,) = [s for s in exported if s.name == "TokenizerServicer.Tokenize"]
    assert server.parent_span_id == parent_id
    assert server.kind == SERVER_KIND
    assert server.service == "tokenizer"


def _wire_request() -> bytes:
    """Caller side: a GenerateRequest made inside the caller's span, as sent."""
    request = common_pb2.GenerateRequest(request_id="r1")
    with tracing.span("gateway.chat_completions"):
        tracing.inject_into(request.trace_context)
    return request.SerializeToString()


async def _serve_request(data: bytes) -> None:
    """Serving side: what arrives on the shared stream, parsed in a task of its own."""
    request = common_pb2.GenerateRequest.FromString(data)
    with tracing.span_from("worker.generate", request.trace_context, request_id=request.request_id):
        phase = tracing.PhaseSpan("worker.prefill")
        await asyncio.sleep(0)
        phase.end()


def _one(spans: list[SpanRecord], name: str) -> SpanRecord:
    matches = [s for s in spans if s.name == name]
    assert len(matches) == 1, f"{name}: {matches}"
    return matches[0]


@pytest.mark.timeout(30)
async def test_trace_context_map_links_spans_across_the_wire() -> None:
    async with otlp_receiver() as rx:
        async with otlp_tracing(rx, service="mesh"):
            data = await asyncio.to_thread(_wire_request)  # another thread: another context
            with tracing.span("unrelated.current_span"):
                # span_from must take its parent from the map, not from what is current.
                await asyncio.create_task(_serve_request(data))
            assert await tracing.flush_tracing()
            names = {"gateway.chat_completions", "worker.generate", "worker.prefill"}
            spans = await rx.wait_for(lambda got: names <= {s.name for s in got}, timeout_s=5)
    root = _one(spans, "gateway.chat_completions")
    served = _one(spans, "worker.generate")
    prefill = _one(spans, "worker.prefill")
    assert served.trace_id == root.trace_id == prefill.trace_id
    assert served.parent_span_id == root.span_id and served.kind == SERVER_KIND
    assert prefill.parent_span_id == served.span_id
    assert served.attributes == {"request_id": "r1"}
    assert not tracing.enabled(), "otlp_tracing leaves tracing off"
