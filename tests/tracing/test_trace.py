"""One trace per request across gateway → tokenizer → scheduler → worker.

Every service runs in this process (real gRPC servers on loopback, real engine on a
tiny model) with the in-memory span exporter, so all spans can be inspected.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from meshserve.v1 import scheduler_pb2_grpc
from scheduler_svc.app import Scheduler
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.servicer import SchedulerServicer
from services import tracing
from services.redis_client import free_port
from services.server import GrpcServer
from tokenizer_svc.config import TokenizerConfig
from tokenizer_svc.server import start_server
from worker_svc.config import WorkerConfig
from worker_svc.main import WorkerProcess


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
    worker = WorkerProcess(
        WorkerConfig(
            port=0,
            model_dir=str(model_dir),
            worker_id="w0",
            tracing="memory",
            kv_cache_memory_mb=16,
            scheduler_address=f"127.0.0.1:{sched_server.port}",
        )
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


def _by_name(spans: list[Any], name: str) -> Any:
    matches = [s for s in spans if s.name == name]
    assert matches, f"no span {name!r} among {sorted({s.name for s in spans})}"
    return matches[0]


def _ancestors(span: Any, by_id: dict[int, Any]) -> list[str]:
    names = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        names.append(span.name)
    return names


async def test_one_trace_links_every_service(tiny_model_dir: Path) -> None:
    async with _mesh(tiny_model_dir) as url:
        exporter = tracing.MEMORY_EXPORTER
        assert exporter is not None
        exporter.clear()  # type: ignore[attr-defined]
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
        await asyncio.sleep(0.2)  # spans end as the streams close
        spans = list(exporter.get_finished_spans())  # type: ignore[attr-defined]
    root = _by_name(spans, "gateway.chat_completions")
    trace_spans = [s for s in spans if s.context.trace_id == root.context.trace_id]
    by_id = {s.context.span_id: s for s in trace_spans}
    render = _by_name(trace_spans, "TokenizerServicer.RenderChat")
    generate = _by_name(trace_spans, "SchedulerServicer.Generate")
    worker = _by_name(trace_spans, "DecoderServicer.Generate")
    for phase in ("worker.prefill", "worker.decode"):
        assert "worker.generate" in _ancestors(_by_name(trace_spans, phase), by_id)
    assert "gateway.chat_completions" in _ancestors(render, by_id)
    assert "gateway.chat_completions" in _ancestors(generate, by_id)
    assert "SchedulerServicer.Generate" in _ancestors(worker, by_id)
    detok = _by_name(trace_spans, "TokenizerServicer.DetokenizeStream")
    assert "gateway.chat_completions" in _ancestors(detok, by_id)
    assert "gateway.chat_completions" in _ancestors(worker, by_id)
