"""Worker process: load the model, serve the Worker RPCs, keep registered with the
scheduler, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence

import torch

from meshserve.v1 import scheduler_pb2, worker_pb2_grpc
from services.config import load_config
from services.log import setup_logging
from services.server import GrpcServer
from worker_svc import metrics as worker_metrics
from worker_svc.config import WorkerConfig
from worker_svc.embedding import EmbeddingModel
from worker_svc.engine.async_engine import AsyncLLMEngine
from worker_svc.engine.config import EngineConfig
from worker_svc.registration import SchedulerLink
from worker_svc.servicer import DecoderServicer, EmbeddingServicer, WorkerIdentity, load_stats

log = logging.getLogger(__name__)

SERVICE = "meshserve.v1.Worker"


def engine_config(config: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        model_dir=config.model_dir,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks or None,
        kv_cache_memory_bytes=config.kv_cache_memory_mb * 1024 * 1024,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len or None,
        enable_prefix_caching=config.enable_prefix_caching,
        dtype=config.dtype,
        device=config.device,
        attention_backend=config.attention_backend,
    )


def _identity(config: WorkerConfig) -> WorkerIdentity:
    worker_id = config.worker_id or f"{config.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return WorkerIdentity(worker_id=worker_id, model=config.model_name, role=config.role)


def _descriptor(config: WorkerConfig, identity: WorkerIdentity, port: int) -> scheduler_pb2.WorkerDescriptor:
    return scheduler_pb2.WorkerDescriptor(
        worker_id=identity.worker_id,
        address=config.advertise_address or f"{config.host}:{port}",
        role=config.role,
        model=identity.model,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
    )


async def _start_decoder(
    config: WorkerConfig, identity: WorkerIdentity, server: GrpcServer
) -> AsyncLLMEngine:
    publisher = None
    if config.redis_url:
        from worker_svc.kv_events import KvEventPublisher

        publisher = KvEventPublisher(config.redis_url, identity.worker_id)
    engine = await asyncio.to_thread(
        AsyncLLMEngine, engine_config(config), publisher.publish if publisher is not None else None
    )
    engine.start()
    server.add_service(
        SERVICE, worker_pb2_grpc.add_WorkerServicer_to_server, DecoderServicer(engine, identity)
    )
    return engine


async def _refresh_metrics(load: Callable[[], object], period_s: float = 1.0) -> None:
    """Keeps the /metrics gauges fresh even when no scheduler polls this worker."""
    while True:
        load()
        await asyncio.sleep(period_s)


async def main(argv: Sequence[str]) -> None:
    config = load_config(WorkerConfig, argv, prog="worker_svc")
    setup_logging(f"worker:{config.role}", config.log_level)
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    identity = _identity(config)
    server = GrpcServer(f"worker-{identity.worker_id}", config)
    engine: AsyncLLMEngine | None = None
    if config.role == "decoder":
        engine = await _start_decoder(config, identity, server)
        load = lambda: worker_metrics.record(load_stats(engine))  # noqa: E731
    elif config.role == "embedding":
        model = await asyncio.to_thread(EmbeddingModel, config.model_dir, config.device)
        embed = EmbeddingServicer(model, identity)
        server.add_service(SERVICE, worker_pb2_grpc.add_WorkerServicer_to_server, embed)
        load = embed.load
    else:
        raise SystemExit(f"role {config.role!r} is not implemented in this worker build")
    port = await server.start()
    descriptor = _descriptor(config, identity, port)
    if engine is not None:
        info = engine.model_info
        descriptor.max_model_len = info.max_model_len
        descriptor.num_total_blocks = engine.stats().num_total_blocks
    link = SchedulerLink(config.scheduler_address, descriptor, load) if config.scheduler_address else None
    if link is not None:
        server.on_drain(link.drain)
        link.start()
    refresher = asyncio.create_task(_refresh_metrics(load)) if config.metrics_port > 0 else None
    await server.set_serving(True)
    log.info(
        "worker %s (%s, pid %d) serving %s on port %d",
        identity.worker_id,
        config.role,
        os.getpid(),
        identity.model,
        port,
    )
    await server.run_until_signal()
    if refresher is not None:
        refresher.cancel()
    if link is not None:
        await link.close()
    if engine is not None:
        await engine.shutdown()
