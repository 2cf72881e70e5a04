"""One trace per request across gateway → tokenizer → scheduler (RouteStream) → worker.

Every service runs in this process (real gRPC servers on loopback, real engine on a
tiny model); spans are exported with OTLP over gRPC (BatchSpanProcessor) to a real OTLP
receiver in the test, which checks that one chat completion's spans form one tree.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from meshserve.v1 import scheduler_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.servicer import SchedulerServicer
from services import tracing
from services.ports import free_port
from services.server import GrpcServer
from tests.tracing.otlp_receiver import SpanRecord, otlp_receiver, otlp_tracing
from tests.worker_svc.worker_kit import worker_process
from tokenizer_svc.config import TokenizerConfig
from tokenizer_svc.server import start_server


async def _scheduler() -> tuple[GrpcServer, Scheduler]:
    config = SchedulerConfig(port=0, tracing="memory")
    scheduler = Scheduler(config)
    server = GrpcServer("scheduler", config)
    server.add_service(
        "meshserve.v1.Scheduler",
        scheduler_pb2_grpc.add_SchedulerServicer_to_server,
        SchedulerServicer(scheduler),
    )
    await scheduler.start()
    await server.start()
    await server.set_serving(True)
    return server, scheduler


@contextlib.asynccontextmanager
async def _mesh(model_dir: Path) -> AsyncIterator[str]:
    sched_server, scheduler = await _scheduler()
    tok_server, _ = await start_server(TokenizerConfig(port=0, model_dir=str(model_dir), tracing="memory"))
    worker = worker_process(
        model_dir,
        worker_id="w0",
        tracing="memory",
        kv_cache_memory_mb=16,
        scheduler_address=f"127.0.0.1:{sched_server.port}",
    )
    await worker.start()
    port = free_port()
    app = create_app(
        GatewayConfig(
            port=port,
            tracing="memory",
            tokenizer_address=f"127.0.0.1:{tok_server.port}",
            scheduler_address=f"127.0.0.1:{sched_server.port}",
        )
    )
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(http.serve())
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(300):
                with contextlib.suppress(httpx.ConnectError):
                    if (await client.get(url + "/health")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
        yield url
    finally:
        http.should_exit = True
        await serving
        for server in (worker.server, tok_server, sched_server):
            await server.server.stop(0)
        await worker.close()
        await scheduler.stop()


def _by_name(spans: list[SpanRecord], name: str) -> SpanRecord:
    matches = [s for s in spans if s.name == name]
    assert matches, f"no span {name!r} among {sorted({s.name for s in spans})}"
    return matches[0]


def _ancestors(span: SpanRecord, by_id: dict[str, SpanRecord]) -> list[str]:
    names = []
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        names.append(span.name)
    return names


WANTED = {
    "gateway.chat_completions",
    "scheduler.route",
    "worker.generate",
    "worker.decode",
}


async def test_one_trace_links_every_service(tiny_model_dir: Path) -> None:
    async with otlp_receiver() as rx, otlp_tracing(rx):
        async with _mesh(tiny_model_dir) as url:
            rx.clear()
            async with httpx.AsyncClient(timeout=60) as client:
                reply = await client.post(
                    url + "/v1/chat/completions",
                    json={
                        "model": tiny_model_dir.name,
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": "hello"}],
                    },
                )
            assert reply.status_code == 200, reply.text
            await tracing.flush_tracing()
            spans = await rx.wait_for(lambda got: WANTED <= {r.name for r in got}, timeout_s=15)
    gateway = _by_name(spans, "gateway.chat_completions")
    trace_spans = [s for s in spans if s.trace_id == gateway.trace_id]
    by_id = {s.span_id: s for s in trace_spans}

    # One tree: following parents up, every span of the request's trace reaches the same
    # top (the HTTP server span when it is exported, else the same missing parent id).
    def top_parent(span: SpanRecord) -> str:
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id]
        return span.parent_span_id

    assert len({top_parent(span) for span in trace_spans}) == 1, trace_spans
    render = _by_name(trace_spans, "TokenizerServicer.RenderChat")
    route = _by_name(trace_spans, "scheduler.route")
    worker = _by_name(trace_spans, "worker.generate")
    assert "gateway.chat_completions" in _ancestors(render, by_id)
    assert "gateway.chat_completions" in _ancestors(route, by_id)
    # The worker's span is parented through the request's trace context (the stream is
    # shared by every request, so per-call metadata cannot carry it).
    assert "gateway.chat_completions" in _ancestors(worker, by_id)
    for phase in ("worker.prefill", "worker.decode"):
        assert _ancestors(_by_name(trace_spans, phase), by_id)[0] == "worker.generate"


async def test_the_gateway_span_of_a_streamed_request_covers_it_to_the_end(tiny_model_dir: Path) -> None:
    """A streamed chat completion's gateway span ends when its response ends (after the
    worker's decode), not when the handler hands the response over to the server."""
    async with otlp_receiver() as rx, otlp_tracing(rx):
        async with _mesh(tiny_model_dir) as url:
            rx.clear()
            body = {
                "model": tiny_model_dir.name,
                "max_tokens": 8,
                "stream": True,
                "messages": [{"role": "user", "content": "hello"}],
            }
            async with (
                httpx.AsyncClient(timeout=60) as client,
                client.stream("POST", url + "/v1/chat/completions", json=body) as reply,
            ):
                assert reply.status_code == 200
                events = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            await tracing.flush_tracing()
            spans = await rx.wait_for(lambda got: WANTED <= {r.name for r in got}, timeout_s=15)
    gateway = _by_name(spans, "gateway.chat_completions")
    by_id = {s.span_id: s for s in spans if s.trace_id == gateway.trace_id}
    decode = _by_name(list(by_id.values()), "worker.decode")
    assert "gateway.chat_completions" in _ancestors(decode, by_id)
    assert gateway.start_ns <= decode.start_ns
    assert gateway.end_ns >= decode.end_ns, "the gateway span ended before the worker's decode"
