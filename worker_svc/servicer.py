"""Worker gRPC servicer: a thin proto ↔ engine layer for the decoder role."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import tracing
from services.errors import InvalidArgument, NotFound
from services.rpc import feed_stream, rpc_handler
from worker_svc.embedding import EmbeddingModel
from worker_svc.engine.async_engine import AsyncLLMEngine
from worker_svc.engine.multimodal import MultiModalInput
from worker_svc.kv_connector import KvImporter
from worker_svc.mm_fetch import EmbeddingFetcher
from worker_svc.stream_session import StreamSession
from worker_svc.torch_thread import TorchThread


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    model: str
    role: str


def load_stats(engine: AsyncLLMEngine) -> worker_pb2.LoadStats:
    s = engine.stats()
    return worker_pb2.LoadStats(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        kv_usage=s.kv_usage,
        num_free_blocks=s.num_free_blocks,
        num_total_blocks=s.num_total_blocks,
        prefix_cache_hit_rate=s.prefix_cache_hit_rate,
        num_preemptions=s.num_preemptions,
        num_finished=s.num_finished,
    )


class DecoderServicer(worker_pb2_grpc.WorkerServicer):
    """Runs generation requests on the worker's engine: `GenerateStream`, the token path
    (many requests per call, batched per engine step, a `StreamSession` each)."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        identity: WorkerIdentity,
        fetcher: EmbeddingFetcher | None = None,
        stream_interval: int = 1,
        draining: Callable[[], bool] = lambda: False,
        kv_importer: KvImporter | None = None,
    ) -> None:
        self.engine = engine
        self.identity = identity
        # P/D: requests whose route named a prefill worker pull their prompt KV with it.
        self.kv_importer = kv_importer
        # Tokens per sequence gathered into one stream message after the first (vLLM's
        # --stream-interval): fewer messages on the way to the client.
        self.stream_interval = stream_interval
        # Fetches image embeddings from the encoder cache (None: no encoder cache configured).
        self.fetcher = fetcher
        self._draining = draining
        self._sessions: set[StreamSession] = set()

    def open_session(self) -> StreamSession:
        """A new session on the engine (one `GenerateStream` call)."""
        fetch = functools.partial(_fetch_mm, self.fetcher) if self.fetcher is not None else None
        session = StreamSession(
            self.engine,
            self.identity.worker_id,
            self.identity.model,
            self.stream_interval,
            fetch,
            self._draining,
            self.kv_importer,
        )
        self._sessions.add(session)
        return session

    def end_session(self, session: StreamSession) -> None:
        """The session's call ended: its requests still running are aborted."""
        session.close()
        self._sessions.discard(session)

    @rpc_handler
    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[worker_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """The token path (see worker.proto): requests in, one message per engine step out
        (written with `context.write`: no generator layers between a step and the wire)."""
        session = self.open_session()
        reader = asyncio.create_task(feed_stream(request_iterator, session, "GenerateStream"))
        try:
            async for message in session.responses():
                await context.write(message)
        finally:
            reader.cancel()
            self.end_session(session)

    def on_drain(self) -> None:
        """The worker started draining: streams end once their requests have finished."""
        for session in self._sessions:
            session.wake()

    def active_lease_ids(self) -> list[str]:
        """Leases of every request running on this worker (heartbeats report them)."""
        return [lease for session in self._sessions for lease in session.active_lease_ids()]

    @rpc_handler
    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadStats:
        return load_stats(self.engine)

    @rpc_handler
    async def GetModelInfo(
        self, request: worker_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ModelInfo:
        info = self.engine.model_info
        return worker_pb2.ModelInfo(
            model=self.identity.model,
            role=self.identity.role,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
        )


async def _fetch_mm(fetcher: EmbeddingFetcher, request: common_pb2.GenerateRequest) -> list[MultiModalInput]:
    """The prompt's image embeddings, fetched from the encoder cache (never encoded here)."""
    with tracing.span("worker.fetch_embeddings", request_id=request.request_id, items=len(request.mm_items)):
        return await fetcher.fetch(request.mm_items)


class EmbeddingServicer(worker_pb2_grpc.WorkerServicer):
    """Embedding role: pooled sentence embeddings, one request at a time on the role's
    torch thread (the one its model was built on: `TorchThread`)."""

    def __init__(
        self, model: EmbeddingModel, thread: TorchThread, identity: WorkerIdentity, max_batch: int = 256
    ) -> None:
        self.model = model
        self._thread = thread
        self.identity = identity
        self.max_batch = max_batch
        self._running = 0
        self._finished = 0

    @rpc_handler
    async def Embed(
        self, request: common_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EmbedResponse:
        """Embeds `inputs`; INVALID_ARGUMENT names the input that is too long or empty."""
        if request.model and request.model != self.identity.model:
            raise NotFound(f"model {request.model!r} is not served by this worker", param="model")
        if not request.inputs or len(request.inputs) > self.max_batch:
            raise InvalidArgument(f"input must hold 1..{self.max_batch} items", param="input")
        self._running += 1
        try:
            result = await self._thread.run(
                self.model.embed, list(request.inputs), request.normalize, request.truncate_prompt_tokens
            )
        finally:
            self._running -= 1
            self._finished += 1
        return common_pb2.EmbedResponse(
            embeddings=[common_pb2.Embedding(values=v) for v in result.vectors],
            prompt_tokens=result.prompt_tokens,
        )

    @rpc_handler
    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadStats:
        return self.load()

    def load(self) -> worker_pb2.LoadStats:
        return worker_pb2.LoadStats(num_running=self._running, num_finished=self._finished)

    @rpc_handler
    async def GetModelInfo(
        self, request: worker_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ModelInfo:
        return worker_pb2.ModelInfo(
            model=self.identity.model, role=self.identity.role, max_model_len=self.model.max_len
        )

    def close(self) -> None:
        """Stops the torch thread once its current call returns."""
        self._thread.shutdown()
