"""Runs admitted requests on workers: Generate streaming with failover, Embed, Abort.

A worker failure (UNAVAILABLE, connection reset, broken stream, worker marked down)
before any token reached the client is retried transparently on another healthy worker
(up to `max_retries`, the failed one excluded and marked suspect). After tokens were
streamed the call ends with UNAVAILABLE "worker X failed after N tokens". When the client
goes away the worker call is cancelled, so the worker aborts the request and frees its
KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc

from meshserve.v1 import common_pb2
from scheduler_svc import metrics
from scheduler_svc.app import RunningRequest, Scheduler
from scheduler_svc.multimodal import REENCODES, EncodeCoordinator
from scheduler_svc.policies import RoutingRequest
from services.errors import Aborted, Code, InvalidArgument, MeshError, Unavailable
from services.rpc import error_from_rpc
from worker_svc.kv_events import request_extra_keys

log = logging.getLogger(__name__)

_TRANSPORT_HINTS = (
    "socket closed",
    "connection reset",
    "connection refused",
    "failed to connect",
    "rst_stream",
    "stream removed",
    "broken pipe",
    "goaway",
    "end of tcp stream",
)


class WorkerFailure(Exception):
    """The worker (not the request) failed: connection lost, stream broken, marked down."""


def is_worker_failure(exc: grpc.aio.AioRpcError) -> bool:
    """True for transport-level failures worth retrying elsewhere."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    details = (exc.details() or "").lower()
    return code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and (
        not details or any(hint in details for hint in _TRANSPORT_HINTS)
    )


def aborted_response(request: common_pb2.GenerateRequest) -> common_pb2.GenerateResponse:
    """The final message of a request aborted before it reached a worker."""
    n = request.sampling.n if request.sampling.HasField("n") and request.sampling.n > 0 else 1
    return common_pb2.GenerateResponse(
        request_id=request.request_id,
        deltas=[
            common_pb2.SequenceDelta(index=i, finish_reason=common_pb2.FINISH_REASON_ABORT) for i in range(n)
        ],
        usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids)),
        finished=True,
    )


@dataclass(eq=False)
class CallHandle:
    """Links one Generate RPC to its current worker call, so client cancellation reaches it."""

    current: RunningRequest | None = None
    closed: bool = False
    overhead_s: float | None = None

    def close(self) -> None:
        """The client call ended (finished or cancelled): cancel the worker call if still open."""
        self.closed = True
        if self.current is not None:
            self.current.cancel_call()


class Forwarder:
    """Generate / Embed / Abort against the workers chosen by the scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.max_retries = scheduler.config.max_retries
        self.mm = EncodeCoordinator(scheduler)

    def routing_request(self, request: common_pb2.GenerateRequest) -> RoutingRequest:
        if not request.model:
            raise InvalidArgument("model is required", param="model")
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        identifiers = [item.identifier for item in request.mm_items]
        return RoutingRequest(
            request_id=request.request_id,
            model=request.model,
            token_ids=request.prompt_token_ids,
            extra_keys=request_extra_keys(request.cache_salt, identifiers),
            priority=request.priority,
            tenant=request.tenant,
        )

    async def generate(
        self, request: common_pb2.GenerateRequest, handle: CallHandle, received_at: float
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Admit, route and stream `request`, failing over before the first token."""
        routing = self.routing_request(request)
        dispatcher = self.scheduler.dispatcher
        exclude: set[str] = set()
        for attempt in range(self.max_retries + 1):
            try:
                lease, _decision = await dispatcher.acquire(routing, frozenset(exclude), retry=attempt > 0)
            except Aborted:
                yield aborted_response(request)
                return
            if attempt == 0:
                handle.overhead_s = time.perf_counter() - received_at
                metrics.OVERHEAD.observe(handle.overhead_s)
            run = RunningRequest(request.request_id, lease)
            try:
                async with contextlib.aclosing(self._stream(request, run, handle)) as stream:
                    async for response in stream:
                        yield response
                return
            except WorkerFailure as failure:
                self.scheduler.worker_failed(run.worker_id)
                if run.tokens_sent or run.messages_sent or attempt == self.max_retries:
                    raise self._give_up(run, failure, attempt) from failure
                metrics.FAILOVERS.labels(outcome="retried").inc()
                log.warning(
                    "request %s: worker %s failed before the first token (%s); retrying",
                    request.request_id,
                    run.worker_id,
                    failure,
                )
                exclude.add(run.worker_id)
            finally:
                self._finish(run, handle)

    async def generate_mm(
        self, request: common_pb2.GenerateRequest, handle: CallHandle
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """A request with images: encode what the encoder cache lacks, then run it on a
        decoder like any other (item payloads stripped). When the decoder finds an item's
        embeddings evicted before it read them (FAILED_PRECONDITION), encode again and
        retry once; a second eviction ends with UNAVAILABLE."""
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        for attempt in range(2):
            worker_request = await self.mm.prepare(request, force=attempt > 0)
            sent = 0
            try:
                async for response in self.generate(worker_request, handle, time.perf_counter()):
                    sent += 1
                    yield response
                return
            except MeshError as exc:
                if exc.code is not Code.FAILED_PRECONDITION or sent:
                    raise
                if attempt:
                    raise Unavailable(
                        f"image embeddings were evicted from the encoder cache twice: {exc}"
                    ) from exc
                REENCODES.inc()
                log.warning("request %s: %s; encoding again", request.request_id, exc)

    def _give_up(self, run: RunningRequest, failure: WorkerFailure, attempt: int) -> Unavailable:
        if run.messages_sent:
            metrics.FAILOVERS.labels(outcome="mid_stream").inc()
            return Unavailable(f"worker {run.worker_id} failed after {run.tokens_sent} tokens: {failure}")
        metrics.FAILOVERS.labels(outcome="exhausted").inc()
        return Unavailable(
            f"worker {run.worker_id} failed before the first token ({failure}); "
            f"gave up after {attempt + 1} attempts"
        )

    async def _stream(
        self, request: common_pb2.GenerateRequest, run: RunningRequest, handle: CallHandle
    ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        spec = run.lease.worker.spec
        call = self.scheduler.channels.stub(spec.worker_id, spec.address).Generate(request)
        run.cancel_call = call.cancel
        self.scheduler.running[request.request_id] = run
        handle.current = run
        if handle.closed:
            call.cancel()
        finished = False
        try:
            async for response in call:
                response.worker_id = spec.worker_id
                run.messages_sent += 1
                run.tokens_sent += sum(len(delta.token_ids) for delta in response.deltas)
                finished = finished or response.finished
                yield response
        except grpc.aio.AioRpcError as exc:
            if is_worker_failure(exc):
                raise WorkerFailure(f"{exc.code().name}: {exc.details() or 'connection lost'}") from exc
            raise error_from_rpc(exc) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            if run.aborted:
                yield aborted_response(request)
                return
            if run.worker_lost:
                raise WorkerFailure("worker stopped heartbeating") from None
            raise
        finally:
            call.cancel()
        if not finished:
            raise WorkerFailure("stream ended before the request finished")

    def _finish(self, run: RunningRequest, handle: CallHandle) -> None:
        if self.scheduler.running.get(run.request_id) is run:
            del self.scheduler.running[run.request_id]
        if handle.current is run:
            handle.current = None
        self.scheduler.dispatcher.release(run.lease)

    async def abort(self, request_id: str) -> bool:
        """Aborts a queued or running request; False when it is unknown."""
        run = self.scheduler.running.get(request_id)
        if run is None:
            return self.scheduler.dispatcher.abort_waiting(request_id)
        spec = run.lease.worker.spec
        stub = self.scheduler.channels.stub(spec.worker_id, spec.address)
        try:
            reply = await stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "abort of %s on worker %s failed (%s); cancelling the call",
                request_id,
                spec.worker_id,
                exc.code().name,
            )
            run.aborted = True
            run.cancel_call()
            return True
        return bool(reply.found)

    async def embed(self, request: common_pb2.EmbedRequest) -> common_pb2.EmbedResponse:
        """Routes an embedding request to an embedding worker for its model."""
        if not request.model:
            raise InvalidArgument("model is required", param="model")
        routing = RoutingRequest(request.request_id or uuid.uuid4().hex, request.model, role="embedding")
        exclude: set[str] = set()
        dispatcher = self.scheduler.dispatcher
        for attempt in range(self.max_retries + 1):
            lease, _ = await dispatcher.acquire(routing, frozenset(exclude), retry=attempt > 0)
            spec = lease.worker.spec
            try:
                reply: common_pb2.EmbedResponse = await self.scheduler.channels.stub(
                    spec.worker_id, spec.address
                ).Embed(request)
                return reply
            except grpc.aio.AioRpcError as exc:
                if not is_worker_failure(exc) or attempt == self.max_retries:
                    raise error_from_rpc(exc) from exc
                self.scheduler.worker_failed(spec.worker_id)
                exclude.add(spec.worker_id)
            finally:
                dispatcher.release(lease)
        raise Unavailable(f"no embedding worker could serve model '{request.model}'")
