"""Worker servicer of the decoder role: a thin proto ↔ engine layer. `Worker.GenerateStream`
(the token path) opens a `GenerateStreamCall` per call on the worker's engine; `LoadLora` /
`UnloadLora` change its adapters; `load_stats` and `lora_state` are the engine's load and
adapters as heartbeats report them. Image embeddings come from the encoder cache (`_fetch_mm`),
never encoded here.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import tracing
from services.errors import FailedPrecondition, InvalidArgument, NotFound
from services.proto_mirror import mirrored
from services.rpc import feed_stream, rpc_handler
from worker_svc.engine.async_engine import AsyncLLMEngine
from worker_svc.engine.engine import LLMEngine
from worker_svc.engine.lora import LoraError, LoraSnapshot, LoraStateError, UnknownLoraError
from worker_svc.engine.multimodal import MultiModalInput
from worker_svc.generate_stream import GenerateStreamCall
from worker_svc.identity import WorkerIdentity
from worker_svc.kv_connector import KvImporter
from worker_svc.mm_fetch import EmbeddingFetcher


def load_stats(engine: AsyncLLMEngine) -> worker_pb2.LoadStats:
    """The engine's load as of its latest step, as heartbeats report it."""
    return mirrored(worker_pb2.LoadStats, engine.stats())


def lora_proto(snap: LoraSnapshot) -> worker_pb2.LoraState:
    """An engine's adapters as the proto reports them."""
    return mirrored(worker_pb2.LoraState, snap)


def lora_state(engine: AsyncLLMEngine) -> worker_pb2.LoraState | None:
    """The engine's adapters as of its latest step (None when LoRA is off)."""
    snap = engine.stats().lora
    return lora_proto(snap) if snap is not None else None


@dataclass(eq=False)
class DecoderServicer(worker_pb2_grpc.WorkerServicer):
    """Runs generation requests on the worker's engine: `GenerateStream`, the token path
    (many requests per call, batched per engine step, a `GenerateStreamCall` each)."""

    engine: AsyncLLMEngine
    identity: WorkerIdentity
    # Fetches image embeddings from the encoder cache (None: no encoder cache configured).
    fetcher: EmbeddingFetcher | None = None
    # Tokens per sequence gathered into one stream message after the first (vLLM's
    # --stream-interval): fewer messages on the way to the client.
    stream_interval: int = 1
    draining: Callable[[], bool] = lambda: False
    # P/D: requests whose route named a prefill worker pull their prompt KV with it.
    kv_importer: KvImporter | None = None
    # Whether LoadLora/UnloadLora may change the adapters (--enable-runtime-lora-updating).
    runtime_lora_updating: bool = False
    _calls: set[GenerateStreamCall] = field(default_factory=set, init=False)

    def open_call(self) -> GenerateStreamCall:
        """The state of a new `GenerateStream` call on the engine."""
        fetch = functools.partial(_fetch_mm, self.fetcher) if self.fetcher is not None else None
        call = GenerateStreamCall(
            self.engine,
            self.identity.worker_id,
            self.identity.model,
            self.stream_interval,
            fetch,
            self.draining,
            self.kv_importer,
        )
        self._calls.add(call)
        return call

    def end_call(self, call: GenerateStreamCall) -> None:
        """The call ended: its requests still running are aborted."""
        call.close()
        self._calls.discard(call)

    @rpc_handler
    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[worker_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """The token path (see worker.proto): requests in, one message per engine step out
        (written with `context.write`: no generator layers between a step and the wire)."""
        call = self.open_call()
        reader = asyncio.create_task(feed_stream(request_iterator, call, "GenerateStream"))
        try:
            async for message in call.responses():
                await context.write(message)
        finally:
            reader.cancel()
            self.end_call(call)

    def on_drain(self) -> None:
        """The worker started draining: streams end once their requests have finished."""
        for call in self._calls:
            call.wake()

    def active_lease_ids(self) -> list[str]:
        """Leases of every request running on this worker (heartbeats report them)."""
        return [lease for call in self._calls for lease in call.active_lease_ids()]

    @rpc_handler
    async def LoadLora(
        self, request: worker_pb2.LoadLoraRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoraState:
        """Load a PEFT adapter directory under `name` (see worker.proto)."""
        self._check_lora_updating()
        if not request.name or not request.path:
            raise InvalidArgument("name and path are required", param="name" if not request.name else "path")

        def load(engine: LLMEngine) -> None:
            engine.load_lora(request.name, request.path)

        await self._lora_call(load)
        return await self._lora_state()

    @rpc_handler
    async def UnloadLora(
        self, request: worker_pb2.UnloadLoraRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoraState:
        """Forget adapter `name` (see worker.proto)."""
        self._check_lora_updating()

        def unload(engine: LLMEngine) -> None:
            engine.unload_lora(request.name)

        await self._lora_call(unload)
        return await self._lora_state()

    async def _lora_state(self) -> worker_pb2.LoraState:
        """The worker's adapters once the change took effect (empty when LoRA is off)."""
        snap = await self.engine.call(lambda engine: engine.stats().lora)
        return lora_proto(snap) if snap is not None else worker_pb2.LoraState()

    def _check_lora_updating(self) -> None:
        if not self.runtime_lora_updating:
            raise FailedPrecondition(
                "LoRA adapters cannot be changed at run time on this worker (--enable-runtime-lora-updating)"
            )

    async def _lora_call(self, fn: Callable[[LLMEngine], None]) -> None:
        try:
            await self.engine.call(fn)
        except UnknownLoraError as exc:
            raise NotFound(str(exc), param="lora_name") from None
        except LoraStateError as exc:
            raise FailedPrecondition(str(exc)) from None
        except LoraError as exc:
            raise InvalidArgument(str(exc), param="lora_path") from None


async def _fetch_mm(fetcher: EmbeddingFetcher, request: common_pb2.GenerateRequest) -> list[MultiModalInput]:
    """The prompt's image embeddings, fetched from the encoder cache (never encoded here)."""
    with tracing.span("worker.fetch_embeddings", request_id=request.request_id, items=len(request.mm_items)):
        return await fetcher.fetch(request.mm_items)
