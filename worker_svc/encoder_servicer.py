"""Worker servicer of the encoder role: `Worker.Encode` runs the vision tower + projector
on multimodal items and `Put`s each item's embeddings into the encoder cache under
`cache_key(model, identifier)`, where decoder workers fetch them.

Encodes run one at a time on the role's torch thread (`TorchThread`, the thread the
model was built on; the embeddings' bytes are made there too); requests wait their turn
in its queue, which is the encoder queue time (`meshserve_encoder_queue_seconds`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import Counter, Histogram

from meshserve.v1 import worker_pb2, worker_pb2_grpc
from services.encoder_cache_client import CachedTensor, EncoderCacheClient, cache_key
from services.errors import InvalidArgument, NotFound
from services.rpc import rpc_handler
from worker_svc.encoder import EncodeInput, VisionEncoder, tensor_bytes
from worker_svc.torch_thread import TorchThread

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
QUEUE_TIME = Histogram(
    "meshserve_encoder_queue_seconds",
    "Time an Encode request waited for the encoder thread before its items ran",
    buckets=_BUCKETS,
)
ENCODE_TIME = Histogram(
    "meshserve_encoder_encode_seconds",
    "Vision tower + projector time of one Encode request (all its items)",
    buckets=_BUCKETS,
)
ITEMS = Counter("meshserve_encoder_items_total", "Multimodal items encoded (vision tower runs per item)")


@dataclass(eq=False)
class EncoderServicer(worker_pb2_grpc.WorkerServicer):
    """Encode of an encoder worker; its load goes out with heartbeats."""

    encoder: VisionEncoder
    thread: TorchThread  # the encoder's model was built on it
    cache: EncoderCacheClient
    model: str
    role: str = "encoder"
    max_items: int = 64
    _waiting: int = field(default=0, init=False)
    _running: int = field(default=0, init=False)
    _finished: int = field(default=0, init=False)  # items encoded since start

    def _inputs(self, request: worker_pb2.EncodeRequest) -> list[EncodeInput]:
        if request.model and request.model != self.model:
            raise NotFound(f"model {request.model!r} is not served by this worker", param="model")
        if not 0 < len(request.items) <= self.max_items:
            raise InvalidArgument(f"items must hold 1..{self.max_items} items", param="items")
        inputs = []
        for i, item in enumerate(request.items):
            if not item.identifier or not item.data or item.length <= 0:
                raise InvalidArgument(f"items[{i}] needs an identifier, data and a length > 0", param="items")
            inputs.append(EncodeInput(item.identifier, item.length, item.dtype, tuple(item.shape), item.data))
        return inputs

    @rpc_handler
    async def Encode(
        self, request: worker_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.EncodeResponse:
        """Encodes the items and stores their embeddings in the encoder cache."""
        inputs = self._inputs(request)
        self._waiting += 1
        try:
            stored, seconds = await self.thread.run(self._encode, inputs, time.perf_counter())
        except ValueError as exc:
            raise InvalidArgument(str(exc), param="items") from exc
        await asyncio.gather(*(self.cache.put(entry) for entry in stored))
        per_item = seconds / len(inputs)
        return worker_pb2.EncodeResponse(
            items=[
                worker_pb2.EncodedItem(
                    identifier=item.identifier,
                    dtype=entry.dtype,
                    shape=list(entry.shape),
                    encode_seconds=per_item,
                )
                for item, entry in zip(inputs, stored, strict=True)
            ]
        )

    def _encode(self, inputs: list[EncodeInput], queued_at: float) -> tuple[list[CachedTensor], float]:
        """Runs on the encoder thread: (the embeddings as cache entries, seconds spent
        encoding). The entries' bytes are made here: a dtype cast or copy of a large
        tensor is a parallel region, which belongs on this thread (TorchThread)."""
        start = time.perf_counter()
        QUEUE_TIME.observe(start - queued_at)
        self._waiting -= 1
        self._running += 1
        try:
            outputs = self.encoder.encode(inputs)
        finally:
            self._running -= 1
        seconds = time.perf_counter() - start
        ENCODE_TIME.observe(seconds)
        ITEMS.inc(len(inputs))
        self._finished += len(inputs)
        return [self._cached(item, tensor) for item, tensor in zip(inputs, outputs, strict=True)], seconds

    def _cached(self, item: EncodeInput, tensor: torch.Tensor) -> CachedTensor:
        dtype, shape, data = tensor_bytes(tensor)
        return CachedTensor(cache_key(self.model, item.identifier), dtype, shape, data)

    def load(self) -> worker_pb2.LoadStats:
        """Encodes running / queued now; `num_finished` counts items encoded since start
        (heartbeats report them)."""
        return worker_pb2.LoadStats(
            num_running=self._running, num_waiting=self._waiting, num_finished=self._finished
        )

    async def close(self) -> None:
        """Stops the encoder thread and closes the cache channel."""
        self.thread.shutdown()
        await self.cache.close()
