"""Multimodal requests with encoding split from decoding (E/PD disaggregation).

Before a request with `mm_items` goes to a decoder, `EncodeCoordinator.prepare` makes
sure every item's embeddings are in the encoder cache:

1. `EncoderCache.Has` on the items' cache keys (`services.encoder_cache_client.cache_key`)
   → hits are skipped (`bypass_encoder_cache` treats everything as a miss, for benchmarks);
2. misses are sent, de-duplicated, in one `Worker.Encode` call to an encoder worker chosen
   by the dispatcher (role "encoder", load-balanced, failover to another encoder when one
   is unreachable); concurrent requests for the same uncached image share one encode;
3. the request is routed to a decoder with the items' `data` stripped: the decoder fetches
   the embeddings from the cache by identifier.

A cache that is down fails the request with UNAVAILABLE naming it, within the client's
deadline (no hang). Domain logic over gRPC stubs; no servicer code here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc
from prometheus_client import Counter, Histogram

from meshserve.v1 import common_pb2, worker_pb2
from scheduler_svc.policies import RoutingRequest
from scheduler_svc.scheduler import Scheduler
from services.encoder_cache_client import EncoderCacheClient, cache_key
from services.errors import InvalidArgument, Unavailable
from services.rpc import error_from_rpc

log = logging.getLogger(__name__)

CACHE_LOOKUPS = Counter(
    "meshserve_scheduler_encoder_cache_lookups_total",
    "Multimodal items checked against the encoder cache before routing, by result (hit, miss, bypass)",
    ["result"],
)
ENCODE_SECONDS = Histogram(
    "meshserve_scheduler_encode_seconds",
    "Duration of Worker.Encode calls made by the scheduler (encoder queue + vision tower + cache Put)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
ENCODED_ITEMS = Counter("meshserve_scheduler_encoded_items_total", "Items sent to encoder workers")
REENCODES = Counter(
    "meshserve_scheduler_mm_reencodes_total",
    "Requests whose embeddings were evicted before the decoder read them (encoded again)",
)


def strip_data(request: common_pb2.GenerateRequest) -> common_pb2.GenerateRequest:
    """A copy of `request` without the items' payloads (the decoder reads the cache)."""
    stripped = common_pb2.GenerateRequest()
    stripped.CopyFrom(request)
    for item in stripped.mm_items:
        item.ClearField("data")
        item.ClearField("dtype")
        del item.shape[:]
    return stripped


class EncodeCoordinator:
    """Encoder cache checks and Encode dispatch for the scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        config = scheduler.config
        self.cache: EncoderCacheClient | None = None
        if config.encoder_cache_address:
            self.cache = EncoderCacheClient(
                config.encoder_cache_address,
                config.encoder_cache_timeout_s,
                max_message_bytes=config.max_message_bytes,
            )
        self._inflight: dict[str, asyncio.Future[None]] = {}

    async def prepare(
        self, request: common_pb2.GenerateRequest, force: bool = False
    ) -> common_pb2.GenerateRequest:
        """Encodes the items the cache lacks (all of them with `force`); returns the
        request to send to a decoder (payloads stripped)."""
        if self.cache is None:
            raise Unavailable(
                "image inputs need an encoder cache: this scheduler has no encoder_cache_address configured"
            )
        if not request.model:
            raise InvalidArgument("model is required", param="model")
        missing = await self._missing(request, force)
        if missing:
            await self._ensure(request, missing)
        return strip_data(request)

    async def _missing(
        self, request: common_pb2.GenerateRequest, force: bool
    ) -> list[common_pb2.MultiModalItem]:
        """Distinct items whose embeddings are not cached, each checked to carry a payload."""
        unique: dict[str, common_pb2.MultiModalItem] = {}
        for item in request.mm_items:
            unique.setdefault(item.identifier, item)
        items = list(unique.values())
        if force or self.scheduler.config.bypass_encoder_cache:
            CACHE_LOOKUPS.labels(result="bypass" if not force else "miss").inc(len(items))
            present = [False] * len(items)
        elif self.cache is None:  # prepare checks this first
            raise Unavailable("no encoder cache configured")
        else:
            present = await self.cache.has([cache_key(request.model, i.identifier) for i in items])
            CACHE_LOOKUPS.labels(result="hit").inc(sum(present))
            CACHE_LOOKUPS.labels(result="miss").inc(len(items) - sum(present))
        missing = [item for item, hit in zip(items, present, strict=True) if not hit]
        for item in missing:
            if not item.data:
                raise InvalidArgument(
                    f"mm_items ({item.identifier}) is not in the encoder cache and carries no data to encode",
                    param="mm_items",
                )
        return missing

    async def _ensure(
        self, request: common_pb2.GenerateRequest, items: list[common_pb2.MultiModalItem]
    ) -> None:
        """Encodes `items`, sharing encodes already in flight for the same keys."""
        if self.scheduler.config.bypass_encoder_cache:  # the no-cache baseline: every request encodes
            await self._encode(request, items)
            return
        own: list[common_pb2.MultiModalItem] = []
        shared: list[tuple[asyncio.Future[None], common_pb2.MultiModalItem]] = []
        for item in items:
            future = self._inflight.get(cache_key(request.model, item.identifier))
            if future is None:
                own.append(item)
            else:
                shared.append((future, item))
        if own:
            await self._encode_own(request, own)
        for future, item in shared:
            try:
                await asyncio.shield(future)
            except Exception:  # the other request's encode failed or was cancelled: do it here
                await self._encode(request, [item])

    async def _encode_own(
        self, request: common_pb2.GenerateRequest, items: list[common_pb2.MultiModalItem]
    ) -> None:
        loop = asyncio.get_running_loop()
        futures = {cache_key(request.model, item.identifier): loop.create_future() for item in items}
        self._inflight.update(futures)
        error: BaseException | None = None
        try:
            await self._encode(request, items)
        except BaseException as exc:
            error = exc
            raise
        finally:
            for key, future in futures.items():
                if self._inflight.get(key) is future:
                    del self._inflight[key]
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(Unavailable(f"encode failed: {error!r}"))
                    future.exception()  # retrieved: waiters (if any) re-encode on their own

    async def _encode(
        self, request: common_pb2.GenerateRequest, items: Sequence[common_pb2.MultiModalItem]
    ) -> None:
        """One Worker.Encode call on an encoder worker, failing over when one is unreachable."""
        dispatcher = self.scheduler.dispatcher
        routing = RoutingRequest(
            f"{request.request_id}/encode",
            request.model,
            priority=request.priority,
            tenant=request.tenant,
            role="encoder",
        )
        call = worker_pb2.EncodeRequest(request_id=request.request_id, model=request.model, items=list(items))
        exclude: set[str] = set()
        retries = self.scheduler.config.max_retries
        for attempt in range(retries + 1):
            lease, _ = await dispatcher.acquire(routing, frozenset(exclude), retry=attempt > 0)
            spec = lease.worker.spec
            start = time.perf_counter()
            try:
                stub = self.scheduler.channels.stub(spec.worker_id, spec.address)
                await stub.Encode(call, timeout=self.scheduler.config.encode_timeout_s)
                ENCODE_SECONDS.observe(time.perf_counter() - start)
                ENCODED_ITEMS.inc(len(items))
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == retries:
                    raise error_from_rpc(exc) from exc
                log.warning("encoder %s failed (%s); trying another encoder", spec.worker_id, exc.details())
                self.scheduler.worker_failed(spec.worker_id)
                exclude.add(spec.worker_id)
            finally:
                dispatcher.release(lease)
        raise Unavailable(f"no encoder worker could encode the images of request {request.request_id}")

    async def close(self) -> None:
        if self.cache is not None:
            await self.cache.close()
