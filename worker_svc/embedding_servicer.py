"""Worker servicer of the embedding role: `Worker.Embed` runs pooled sentence embeddings
(`EmbeddingModel`) one request at a time on the role's torch thread (`TorchThread`, the
thread the model was built on); its load (running, finished) goes out with heartbeats.
"""

from __future__ import annotations

import grpc

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.errors import InvalidArgument, NotFound
from services.rpc import rpc_handler
from worker_svc.embedding import EmbeddingModel
from worker_svc.identity import WorkerIdentity
from worker_svc.torch_thread import TorchThread


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

    def load(self) -> worker_pb2.LoadStats:
        """Embeddings running now and finished since start (heartbeats report them)."""
        return worker_pb2.LoadStats(num_running=self._running, num_finished=self._finished)

    def close(self) -> None:
        """Stops the torch thread once its current call returns."""
        self._thread.shutdown()
