"""Worker gRPC servicer: a thin proto ↔ engine layer for the decoder role."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

import grpc

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import tracing
from services.errors import InvalidArgument, NotFound, Unavailable
from services.rpc import rpc_handler
from worker_svc import convert
from worker_svc.embedding import EmbeddingModel
from worker_svc.engine.async_engine import AsyncLLMEngine
from worker_svc.engine.engine import RequestOutput
from worker_svc.engine.multimodal import MultiModalInput
from worker_svc.mm_fetch import EmbeddingFetcher

log = logging.getLogger(__name__)

_DONE = object()


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
    """Runs generation requests on the worker's engine and streams every step."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        identity: WorkerIdentity,
        fetcher: EmbeddingFetcher | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.engine = engine
        self.identity = identity
        # Tokens per sequence gathered into one stream message after the first (vLLM's
        # --stream-interval): fewer messages through every hop of the mesh.
        self.stream_interval = stream_interval
        # Fetches image embeddings from the encoder cache (None: no encoder cache configured).
        self.fetcher = fetcher
        # request id → engine request ids (one per parallel sample).
        self._children: dict[str, list[str]] = {}

    def _validate(self, request: common_pb2.GenerateRequest) -> None:
        if not request.request_id:
            raise InvalidArgument("request_id is required", param="request_id")
        if request.model and request.model != self.identity.model:
            raise NotFound(f"model {request.model!r} is not served by this worker", param="model")
        if not request.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids must not be empty", param="prompt")
        if request.request_id in self._children:
            raise InvalidArgument(f"request_id {request.request_id!r} is already running", param="request_id")
        num_tokens = len(request.prompt_token_ids)
        for i, item in enumerate(request.mm_items):
            if item.offset < 0 or item.length < 0 or item.offset + item.length > num_tokens:
                raise InvalidArgument(
                    f"mm_items[{i}] (offset {item.offset}, length {item.length}) lies outside the "
                    f"{num_tokens}-token prompt",
                    param="mm_items",
                )

    @rpc_handler
    async def Generate(
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Streams one GenerateResponse per engine step that produced tokens; the last
        one carries usage and `finished`. Cancelling the call aborts the request."""
        self._validate(request)
        n = convert.num_samples(request.sampling)
        info = self.engine.model_info
        prompt = list(request.prompt_token_ids)
        params = [
            convert.sampling_params(request.sampling, len(prompt), info.max_model_len, i) for i in range(n)
        ]
        extra_keys = _extra_keys(request)
        mm_inputs = await self._mm_inputs(request)
        ids = [request.request_id if n == 1 else f"{request.request_id}#{i}" for i in range(n)]
        self._children[request.request_id] = ids
        try:
            with tracing.span("worker.generate", request_id=request.request_id, n=n):
                async for response in self._run(request, prompt, params, ids, extra_keys, mm_inputs):
                    yield response
        finally:
            self._children.pop(request.request_id, None)
            for child in ids:
                self.engine.abort(child)

    async def _run(
        self,
        request: common_pb2.GenerateRequest,
        prompt: list[int],
        params: list[convert.SamplingParams],
        ids: list[str],
        extra_keys: tuple[str, ...],
        mm_inputs: list[MultiModalInput],
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        queue: asyncio.Queue[object] = asyncio.Queue()
        gens = [
            self.engine.generate(
                rid, prompt, p, priority=request.priority, extra_keys=extra_keys, mm_inputs=mm_inputs
            )
            for rid, p in zip(ids, params, strict=True)
        ]
        tasks = [asyncio.create_task(_pump(i, g, queue)) for i, g in enumerate(gens)]
        usage = common_pb2.Usage(prompt_tokens=len(prompt))
        outbox = _Outbox(request.request_id, self.stream_interval)
        first, remaining = True, len(tasks)
        # Prefill covers the wait in the engine queue plus the prompt's forward passes.
        phase = tracing.PhaseSpan("worker.prefill", prompt_tokens=len(prompt))
        try:
            while remaining:
                for item in await _drain(queue):
                    if item is _DONE:
                        remaining -= 1
                        continue
                    if isinstance(item, BaseException):
                        raise item
                    index, out = cast(tuple[int, RequestOutput], item)
                    outbox.add(convert.sequence_delta(index, out))
                    usage.completion_tokens += len(out.new_token_ids)
                    if index == 0 and out.prompt_logprobs:
                        outbox.response.prompt_logprobs.extend(convert.prompt_logprobs(out))
                    usage.cached_tokens = max(usage.cached_tokens, out.num_cached_tokens)
                if first and (outbox.response.deltas or not remaining):
                    outbox.response.worker_id = self.identity.worker_id
                    phase.end(cached_tokens=usage.cached_tokens)
                    phase = tracing.PhaseSpan("worker.decode")
                if not remaining:
                    outbox.response.finished = True
                    outbox.response.usage.CopyFrom(usage)
                if outbox.due(first, finished=not remaining):
                    first = False
                    yield outbox.take()
        finally:
            phase.end(completion_tokens=usage.completion_tokens)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _mm_inputs(self, request: common_pb2.GenerateRequest) -> list[MultiModalInput]:
        """The prompt's image embeddings, fetched from the encoder cache (never encoded here)."""
        if not request.mm_items:
            return []
        if self.fetcher is None:
            raise Unavailable(
                "this decoder worker has no encoder cache (encoder_cache_address), so it cannot take images"
            )
        with tracing.span(
            "worker.fetch_embeddings", request_id=request.request_id, items=len(request.mm_items)
        ):
            return await self.fetcher.fetch(request.mm_items)

    @rpc_handler
    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        """Aborts a request (all its samples); its KV blocks are freed at once."""
        ids = self._children.get(request.request_id, [request.request_id])
        found = False
        for child in ids:
            found = self.engine.abort(child) or found
        return common_pb2.AbortResponse(found=found or request.request_id in self._children)

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


def _extra_keys(request: common_pb2.GenerateRequest) -> tuple[str, ...]:
    """Keys mixed into block hashes: the cache salt and multimodal identifiers, so
    prompts with different images (or tenants with different salts) never share KV."""
    keys: list[str] = []
    if request.cache_salt:
        keys.append("salt:" + request.cache_salt)
    keys.extend("mm:" + item.identifier for item in request.mm_items)
    return tuple(keys)


async def _pump(index: int, gen: AsyncIterator[RequestOutput], queue: asyncio.Queue[object]) -> None:
    try:
        async for out in gen:
            queue.put_nowait((index, out))
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        queue.put_nowait(exc)
        return
    finally:
        with contextlib.suppress(Exception):
            await gen.aclose()  # type: ignore[attr-defined]
    queue.put_nowait(_DONE)


class _Outbox:
    """The next message of one Generate stream: deltas gather here until it is due."""

    def __init__(self, request_id: str, interval: int) -> None:
        self.request_id = request_id
        self.interval = interval
        self.response = common_pb2.GenerateResponse(request_id=request_id)
        self._pending: dict[int, int] = {}

    def add(self, delta: common_pb2.SequenceDelta) -> None:
        self.response.deltas.append(delta)
        self._pending[delta.index] = self._pending.get(delta.index, 0) + len(delta.token_ids)

    def due(self, first: bool, finished: bool) -> bool:
        """Send now: the end, the first tokens (TTFT), or `interval` tokens of a sequence."""
        if finished:
            return True
        if not self.response.deltas:
            return False
        return first or max(self._pending.values()) >= self.interval

    def take(self) -> common_pb2.GenerateResponse:
        response = self.response
        self.response = common_pb2.GenerateResponse(request_id=self.request_id)
        self._pending.clear()
        return response


async def _drain(queue: asyncio.Queue[object]) -> list[object]:
    """Waits for one item, then takes whatever else is ready: the outputs of one
    engine step for all parallel samples go out in one message."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


class EmbeddingServicer(worker_pb2_grpc.WorkerServicer):
    """Embedding role: pooled sentence embeddings, one request at a time per thread."""

    def __init__(self, model: EmbeddingModel, identity: WorkerIdentity, max_batch: int = 256) -> None:
        self.model = model
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
            result = await asyncio.to_thread(
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
