"""Worker process: load the model, serve the Worker RPCs, keep registered with the
scheduler, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable

import torch
import torch._inductor.config as inductor_config

from meshserve.v1 import kv_transfer_pb2_grpc, scheduler_pb2, worker_pb2, worker_pb2_grpc
from services.cpus import affinity, format_cpus, usable_threads
from services.encoder_cache_client import EncoderCacheClient
from services.log import setup_logging
from services.server import GrpcServer
from services.worker_roles import role_value
from worker_svc import metrics as worker_metrics
from worker_svc.config import WorkerConfig
from worker_svc.decoder_servicer import DecoderServicer, load_stats, lora_state
from worker_svc.embedding import EmbeddingModel
from worker_svc.embedding_servicer import EmbeddingServicer
from worker_svc.encoder import VisionEncoder
from worker_svc.encoder_servicer import EncoderServicer
from worker_svc.engine.async_engine import AsyncLLMEngine
from worker_svc.identity import WorkerIdentity
from worker_svc.kv_connector import KvImporter
from worker_svc.kv_events import KvEventPublisher
from worker_svc.kv_grpc import SERVICE as KV_SERVICE
from worker_svc.kv_grpc import GrpcKvConnector, KvTransferServicer, layout_to_proto
from worker_svc.mm_fetch import EmbeddingFetcher
from worker_svc.registration import SchedulerLink
from worker_svc.torch_thread import TorchThread

log = logging.getLogger(__name__)

SERVICE = "meshserve.v1.Worker"


def _identity(config: WorkerConfig) -> WorkerIdentity:
    worker_id = config.worker_id or f"{config.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return WorkerIdentity(worker_id=worker_id, model=config.model_name, role=config.role)


def _descriptor(config: WorkerConfig, identity: WorkerIdentity, port: int) -> scheduler_pb2.WorkerDescriptor:
    return scheduler_pb2.WorkerDescriptor(
        worker_id=identity.worker_id,
        address=config.advertise_address or f"{config.host}:{port}",
        role=role_value(config.role),
        model=identity.model,
        block_size=config.engine.block_size,
        max_num_seqs=config.engine.max_num_seqs,
    )


def _kv_publisher(config: WorkerConfig, identity: WorkerIdentity) -> KvEventPublisher | None:
    """KV events go to Redis for the scheduler's prefix index (none without Redis)."""
    if not config.redis_url:
        return None
    return KvEventPublisher(
        config.redis_url, identity.worker_id, flush_interval_s=config.kv_events_flush_ms / 1000
    )


async def _start_decoder(
    config: WorkerConfig, identity: WorkerIdentity, server: GrpcServer, publisher: KvEventPublisher | None
) -> tuple[AsyncLLMEngine, DecoderServicer]:
    engine = await asyncio.to_thread(
        AsyncLLMEngine, config.engine, publisher.publish if publisher is not None else None
    )
    # A prefill worker's short streams move to a decoder before a long prefill (P/D).
    engine.engine.moves_streams = config.role == "prefill"
    engine.start()
    # Its KV layout names the served model, so only workers of that model pair up (P/D).
    engine.engine.kv.layout = engine.engine.kv_layout(identity.model)
    fetcher = _embedding_fetcher(config, identity, engine)
    # Decoders pull hand-offs and shared prefixes; so does a prefill worker taking whole
    # requests (the scheduler's pd_prefill_decodes).
    connector = GrpcKvConnector(config.max_message_bytes)
    importer = KvImporter(engine, connector, engine.engine.kv.layout, config.kv_transfer_timeout_s)
    servicer = DecoderServicer(
        engine,
        identity,
        fetcher,
        stream_interval=config.stream_interval,
        draining=lambda: server.draining,
        kv_importer=importer,
        runtime_lora_updating=config.enable_runtime_lora_updating,
    )
    server.add_service(SERVICE, worker_pb2_grpc.add_WorkerServicer_to_server, servicer)

    async def end_streams() -> None:
        servicer.on_drain()

    server.on_drain(end_streams)
    return engine, servicer


def _cache_client(config: WorkerConfig) -> EncoderCacheClient:
    return EncoderCacheClient(
        config.encoder_cache_address,
        config.encoder_cache_timeout_s,
        max_message_bytes=config.max_message_bytes,
    )


def _embedding_fetcher(
    config: WorkerConfig, identity: WorkerIdentity, engine: AsyncLLMEngine
) -> EmbeddingFetcher | None:
    """Image embeddings come from the encoder cache; without one the decoder takes text only."""
    if not config.encoder_cache_address:
        return None
    return EmbeddingFetcher(_cache_client(config), identity.model, engine.model_info.hidden_size)


async def _start_encoder(
    config: WorkerConfig, identity: WorkerIdentity, server: GrpcServer
) -> EncoderServicer:
    """Encoder role: vision tower + projector only; embeddings go to the encoder cache."""
    thread = TorchThread("meshserve-encoder")
    encoder = await thread.run(VisionEncoder, config.model_dir, config.engine.device, config.engine.dtype)
    servicer = EncoderServicer(encoder, thread, _cache_client(config), identity.model, identity.role)
    server.add_service(SERVICE, worker_pb2_grpc.add_WorkerServicer_to_server, servicer)
    return servicer


class WorkerProcess:
    """One worker: its gRPC server, its model (engine or embedder) and its scheduler link."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.identity = _identity(config)
        self.server = GrpcServer(f"worker-{self.identity.worker_id}", config)
        self.engine: AsyncLLMEngine | None = None
        self.encoder: EncoderServicer | None = None
        self.embedding: EmbeddingServicer | None = None
        self.link: SchedulerLink | None = None
        self.publisher: KvEventPublisher | None = None
        self._load: Callable[[], worker_pb2.LoadStats] | None = None
        self.decoder: DecoderServicer | None = None
        self.kv_transfer: KvTransferServicer | None = None

    async def _load_model(self) -> Callable[[], worker_pb2.LoadStats]:
        config, identity, server = self.config, self.identity, self.server
        if config.role in ("decoder", "prefill"):
            self.publisher = _kv_publisher(config, identity)
            engine, decoder = await _start_decoder(config, identity, server, self.publisher)
            self.engine = engine
            self.decoder = decoder
            # A prefill worker's hand-offs; a decoder's prefix, shared with another decoder
            # (scheduler_svc/kv_share.py).
            self.kv_transfer = KvTransferServicer(engine, identity.model, lambda: server.draining)
            server.add_service(
                KV_SERVICE, kv_transfer_pb2_grpc.add_KvTransferServicer_to_server, self.kv_transfer
            )
            return lambda: load_stats(engine)
        if config.role == "embedding":
            thread = TorchThread("meshserve-embedding")
            model = await thread.run(EmbeddingModel, config.model_dir, config.engine.device)
            self.embedding = EmbeddingServicer(model, thread, identity)
            server.add_service(SERVICE, worker_pb2_grpc.add_WorkerServicer_to_server, self.embedding)
            return self.embedding.load
        if config.role == "encoder":
            self.encoder = await _start_encoder(config, identity, server)
            return self.encoder.load
        raise SystemExit(f"role {config.role!r} is not implemented in this worker build")

    async def start(self) -> int:
        """Loads the model, serves, registers with the scheduler; returns the port."""
        load = await self._load_model()
        port = await self.server.start()
        descriptor = _descriptor(self.config, self.identity, port)
        if self.engine is not None:
            descriptor.max_model_len = self.engine.model_info.max_model_len
            descriptor.num_total_blocks = self.engine.stats().num_total_blocks
            descriptor.kv_layout.CopyFrom(layout_to_proto(self.engine.engine.kv.layout))
        engine = self.engine
        loras = (lambda: lora_state(engine)) if engine is not None else (lambda: None)
        if self.config.scheduler_address:
            self.link = SchedulerLink(
                self.config.scheduler_address, descriptor, load, self._active_leases, loras
            )
            self.server.on_drain(self.link.drain)
            self.link.start()
        if self.config.metrics_port > 0 and self.engine is not None:
            worker_metrics.watch(load, loras, lambda: engine.stats().kv_tier if engine is not None else None)
        await self.server.set_serving(True)
        log.info(
            "worker %s (%s, pid %d) serving %s on port %d",
            self.identity.worker_id,
            self.config.role,
            os.getpid(),
            self.identity.model,
            port,
        )
        return port

    def _active_leases(self) -> list[str]:
        """Leases of the requests this worker runs (decoders) or prefills and holds the
        KV of (prefill workers), reported in heartbeats."""
        leases = self.decoder.active_lease_ids() if self.decoder is not None else []
        if self.kv_transfer is not None:
            leases.extend(self.kv_transfer.active_lease_ids())
        return leases

    async def close(self) -> None:
        """Releases what `start` acquired (after the server has drained and stopped)."""
        if self.link is not None:
            await self.link.close()
        if self.decoder is not None and self.decoder.kv_importer is not None:
            await self.decoder.kv_importer.connector.close()
        if self.engine is not None:
            await self.engine.shutdown()
        if self.publisher is not None:
            # Flushes the events of the last steps, then stops the publisher thread.
            await asyncio.to_thread(self.publisher.close)
        if self.encoder is not None:
            await self.encoder.close()
        if self.embedding is not None:
            self.embedding.close()


async def main(config: WorkerConfig) -> None:
    setup_logging(f"worker:{config.role}", config.log_level)
    # Auto: what this process may use (its affinity, its cgroup's CPU quota), not the host's
    # core count torch would take (docs/design-decisions.md, "Engines on one machine get
    # disjoint cores").
    torch.set_num_threads(config.num_threads or usable_threads())
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # Inductor sizes its pool of compile workers from the affinity alone; under a CPU
        # quota the extra processes add memory (enough to pass a pod's limit) and no speed.
        inductor_config.compile_threads = usable_threads()
    log.info("%d torch threads, CPUs %s", torch.get_num_threads(), format_cpus(affinity()))
    worker = WorkerProcess(config)
    await worker.start()
    try:
        await worker.server.run_until_signal()
    finally:
        await worker.close()
