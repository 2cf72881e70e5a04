"""The gRPC KV connector (kv_transfer.proto), both halves: `GrpcKvConnector`, the decode
worker's client, and `KvTransferServicer`, the prefill worker's service. Thin proto <->
domain layers over `kv_connector` and the engine's `kv` hand-off."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from meshserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from services import tracing
from services.errors import InvalidArgument, NotFound, Unavailable
from services.kv_contract import request_extra_keys
from services.rpc import PEER_LOST, REQUEST_PING_MS, REQUEST_PING_TIMEOUT_MS, open_channel, rpc_handler
from worker_svc import metrics
from worker_svc.engine.async_engine import AsyncLLMEngine
from worker_svc.engine.engine import RequestOutput
from worker_svc.engine.kv_handoff import ExportManifest
from worker_svc.engine.kv_transfer import KvBlockPayload, KvLayout, KvTransferError
from worker_svc.engine.request import RequestSpec
from worker_svc.engine.sampling import SamplingParams
from worker_svc.kv_connector import KVConnector, PrefillJob, PublishedTransfer, TransferSource

__all__ = ["FAULT_ENV", "GrpcKvConnector", "KvTransferServicer", "layout_from_proto", "layout_to_proto"]

log = logging.getLogger(__name__)

SERVICE = "meshserve.v1.KvTransfer"
# Test-only fault injection on the decode side: "corrupt" flips one byte of the first
# block of every pull after it arrived (the checksum must catch it).
FAULT_ENV = "MESHSERVE_TEST_KV_FAULT"


def layout_to_proto(layout: KvLayout) -> kv_transfer_pb2.KvLayout:
    return kv_transfer_pb2.KvLayout(**dataclasses.asdict(layout))


def layout_from_proto(message: kv_transfer_pb2.KvLayout) -> KvLayout:
    return KvLayout(
        message.model,
        message.dtype,
        message.num_layers,
        message.num_kv_heads,
        message.head_dim,
        message.block_size,
    )


def _transfer_error(exc: grpc.aio.AioRpcError) -> KvTransferError:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KvTransferError("timeout", f"prefill worker: {exc.details()}")
    if code in PEER_LOST:
        return KvTransferError("unavailable", f"prefill worker: {exc.details()}")
    return KvTransferError("error", f"prefill worker: {code.name} {exc.details()}")


class GrpcKvConnector(KVConnector):
    """KV over gRPC from the prefill worker's KvTransfer service (one channel per address)."""

    def __init__(self, max_message_bytes: int = 64 * 1024 * 1024, fault: str | None = None) -> None:
        self._max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._fault = os.environ.get(FAULT_ENV, "") if fault is None else fault

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KvTransferStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(
                address, self._max_message_bytes, REQUEST_PING_MS, REQUEST_PING_TIMEOUT_MS
            )
        return kv_transfer_pb2_grpc.KvTransferStub(channel)

    async def publish(self, source: TransferSource, job: PrefillJob) -> PublishedTransfer:
        request = kv_transfer_pb2.PrefillRequest(
            transfer_id=source.transfer_id,
            model=job.model,
            prompt_token_ids=job.prompt_token_ids,
            cache_salt=job.cache_salt,
            priority=job.priority,
            lease_id=source.lease_id,
            trace_context=dict(job.trace_context),
        )
        try:
            reply = await self._stub(source.address).Prefill(request)
        except grpc.aio.AioRpcError as exc:
            raise _transfer_error(exc) from exc
        return PublishedTransfer(
            reply.transfer_id,
            layout_from_proto(reply.layout),
            tuple(reply.block_hashes),
            reply.first_token_id,
            reply.num_cached_tokens,
        )

    async def pull(
        self, source: TransferSource, blocks_per_chunk: int
    ) -> AsyncIterator[list[KvBlockPayload]]:
        call = self._stub(source.address).Pull(
            kv_transfer_pb2.PullRequest(transfer_id=source.transfer_id, blocks_per_chunk=blocks_per_chunk)
        )
        first = True
        try:
            async for chunk in call:
                payloads = [KvBlockPayload(b.index, b.block_hash, b.data, b.checksum) for b in chunk.blocks]
                if first and payloads and self._fault == "corrupt":
                    payloads[0] = _corrupted(payloads[0])
                first = False
                yield payloads
        except grpc.aio.AioRpcError as exc:
            raise _transfer_error(exc) from exc
        finally:
            call.cancel()

    async def release(self, source: TransferSource) -> None:
        try:
            await self._stub(source.address).Release(
                kv_transfer_pb2.ReleaseTransferRequest(transfer_id=source.transfer_id), timeout=5.0
            )
        except grpc.aio.AioRpcError as exc:  # gone: its TTL (or its death) freed the KV
            log.debug("release of transfer %s: %s", source.transfer_id, exc.code().name)

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()


def _corrupted(payload: KvBlockPayload) -> KvBlockPayload:
    data = bytearray(payload.data)
    data[len(data) // 2] ^= 0x01
    return dataclasses.replace(payload, data=bytes(data))


_PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    """A worker's KV hand-off: prefill-only requests on its engine, their KV held for pulls
    (engine ``kv``: held transfers, readers, TTL). On a prefill worker, P/D's prompts; on a
    decoder, the prefix it shares with another decoder (mostly cached: one token computed)."""

    def __init__(
        self, engine: AsyncLLMEngine, model: str, draining: Callable[[], bool] = lambda: False
    ) -> None:
        self.engine = engine
        self.model = model
        self._draining = draining
        self._leases: dict[str, str] = {}  # transfer id -> lease id, while prefilling or held
        self._prefilling: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    def active_lease_ids(self) -> list[str]:
        """Leases of the transfers being prefilled or held (for heartbeats)."""
        held = self.engine.engine.kv.held
        for tid in [t for t in self._leases if t not in held and t not in self._prefilling]:
            del self._leases[tid]  # expired (TTL) or released
        return list(self._leases.values())

    @rpc_handler
    async def Prefill(
        self, request: kv_transfer_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.PrefillResponse:
        """Prefill the prompt, hold its KV under ``transfer_id``; answers once held."""
        _validate_prefill(request, self.model)
        if self._draining():
            raise Unavailable("prefill worker is draining")
        tid = request.transfer_id
        span = tracing.PhaseSpan.from_carrier("worker.prefill_only", request.trace_context, transfer_id=tid)
        if request.lease_id:
            self._leases[tid] = request.lease_id
        self._prefilling.add(tid)
        try:
            out = await self._run_prefill(request)
            manifest: ExportManifest = self.engine.engine.kv.manifest(tid)  # no step's wait
        except BaseException:
            self._leases.pop(tid, None)
            self._spawn(self.engine.call(lambda engine: engine.kv.release(tid)))
            raise
        finally:
            self._prefilling.discard(tid)
            span.end()
        return kv_transfer_pb2.PrefillResponse(
            transfer_id=tid,
            layout=layout_to_proto(self.engine.engine.kv.layout),
            num_blocks=len(manifest.block_ids),
            block_hashes=manifest.block_hashes,
            first_token_id=manifest.first_token_id,
            num_cached_tokens=out.num_cached_tokens,
        )

    async def _run_prefill(self, request: kv_transfer_pb2.PrefillRequest) -> RequestOutput:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[RequestOutput] = loop.create_future()
        child = f"prefill-{request.transfer_id}"

        def sink(item: RequestOutput | BaseException) -> None:
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
            elif item.finished:
                done.set_result(item)

        keys = request_extra_keys(request.cache_salt)
        spec = RequestSpec(
            child,
            list(request.prompt_token_ids),
            _PREFILL_PARAMS,
            priority=request.priority,
            extra_keys=keys,
            transfer_id=request.transfer_id,
        )
        self.engine.submit(spec, sink)
        try:
            out = await done
        except asyncio.CancelledError:
            self.engine.abort(child, drop_output=True)
            raise
        if out.finish_reason == "abort":
            raise Unavailable("prefill was aborted")
        return out

    @rpc_handler
    async def Pull(
        self, request: kv_transfer_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_transfer_pb2.KvChunk]:
        """The held blocks in order, ``blocks_per_chunk`` per message; the end releases them."""
        tid = request.transfer_id
        per = request.blocks_per_chunk or 4
        if per < 1:
            raise InvalidArgument("blocks_per_chunk must be >= 1", param="blocks_per_chunk")
        try:
            manifest: ExportManifest = self.engine.engine.kv.begin_export(tid)  # no step's wait
        except KeyError:
            raise NotFound(
                f"transfer {tid!r} is not held here (released or expired)", param="transfer_id"
            ) from None
        complete = False
        try:
            kv = self.engine.engine.kv
            for start in range(0, len(manifest.block_ids), per):
                payloads = await asyncio.to_thread(kv.read_blocks, manifest, start, per)
                metrics.KV_TRANSFER_BYTES.labels(direction="sent").inc(sum(len(p.data) for p in payloads))
                yield kv_transfer_pb2.KvChunk(blocks=[_block(p) for p in payloads])
            complete = True
        finally:
            if complete:
                self._leases.pop(tid, None)
            # Not awaited here: the call may be cancelled; the engine runs it regardless.
            self._spawn(self.engine.call(lambda engine: engine.kv.end_export(tid, complete)))

    @rpc_handler
    async def Release(
        self, request: kv_transfer_pb2.ReleaseTransferRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.ReleaseTransferResponse:
        """Releases a held transfer (after its reader, if one is pulling)."""
        tid = request.transfer_id
        self._leases.pop(tid, None)
        released = await self.engine.call(lambda engine: engine.kv.release(tid))
        return kv_transfer_pb2.ReleaseTransferResponse(released=bool(released))

    def _spawn(self, awaitable: Any) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _block(payload: KvBlockPayload) -> kv_transfer_pb2.KvBlock:
    return kv_transfer_pb2.KvBlock(
        index=payload.index, block_hash=payload.block_hash, data=payload.data, checksum=payload.checksum
    )


def _validate_prefill(request: kv_transfer_pb2.PrefillRequest, model: str) -> None:
    if not request.transfer_id:
        raise InvalidArgument("transfer_id is required", param="transfer_id")
    if request.model and request.model != model:
        raise NotFound(f"model {request.model!r} is not served by this worker", param="model")
    if not request.prompt_token_ids:
        raise InvalidArgument("prompt_token_ids must not be empty", param="prompt_token_ids")
