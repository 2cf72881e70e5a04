"""Scheduler orchestration of E/PD disaggregation over real gRPC, during `Route`: a real
encoder cache, fake encoder workers (Encode puts a tensor into the cache) and a fake
decoder.

Checks: a miss is encoded once even for concurrent requests, a hit is not encoded, the
lease carries the items without payload (what the gateway sends the decoder),
`bypass_encoder_cache` encodes every time, `force_encode` (the gateway's answer to a
decoder that found the embeddings evicted) encodes again, an unreachable encoder fails
over, and a dead cache / missing encoders / a missing payload are clear errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest

from encoder_cache_svc.config import EncoderCacheConfig
from encoder_cache_svc.servicer import EncoderCacheServicer, RedisMetadata
from encoder_cache_svc.store import EncoderCacheStore
from meshserve.v1 import common_pb2, encoder_cache_pb2_grpc, worker_pb2
from services.encoder_cache_client import CachedTensor, EncoderCacheClient, cache_key
from services.ports import free_port
from services.server import GrpcServer
from tests.fake_worker import FakeWorker
from tests.scheduler_svc.conftest import RunningScheduler, SchedulerFactory
from tests.scheduler_svc.conftest import start_scheduler as _start_scheduler  # noqa: F401  (a fixture)

PROMPT = [5, 6, 7, 9, 9, 9, 9, 8]


class FakeEncoder(FakeWorker):
    """An encoder worker: Encode stores a (length, 4) float32 tensor per item in the cache."""

    def __init__(self, worker_id: str, cache_address: str, delay: float = 0.05) -> None:
        super().__init__(worker_id, role="encoder")
        self.cache = EncoderCacheClient(cache_address, timeout_s=2.0)
        self.encode_delay = delay
        self.encoded: list[str] = []
        self.calls = 0

    async def Encode(self, request: Any, context: Any) -> Any:
        self.calls += 1
        if self.fail_first:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is broken")
        await asyncio.sleep(self.encode_delay)
        for item in request.items:
            self.encoded.append(item.identifier)
            data = np.full((item.length, 4), 1.0, dtype=np.float32).tobytes()
            await self.cache.put(
                CachedTensor(cache_key(request.model, item.identifier), "float32", (item.length, 4), data)
            )
        return worker_pb2.EncodeResponse()


@pytest.fixture
def schedulers(request: pytest.FixtureRequest) -> SchedulerFactory:
    """Real scheduler servers (tests/scheduler_svc's factory), stopped after the test."""
    factory: SchedulerFactory = request.getfixturevalue("_start_scheduler")
    return factory


@pytest.fixture
async def cache_address() -> AsyncIterator[str]:
    config = EncoderCacheConfig(port=0, capacity_mb=1)
    server = GrpcServer("encoder-cache-test", config)
    servicer = EncoderCacheServicer(
        EncoderCacheStore(1 << 20), RedisMetadata("", "t", ""), config.chunk_bytes
    )
    server.add_service(
        "meshserve.v1.EncoderCache", encoder_cache_pb2_grpc.add_EncoderCacheServicer_to_server, servicer
    )
    port = await server.start()
    await server.set_serving(True)
    yield f"127.0.0.1:{port}"
    await server.server.stop(0)


async def _mesh(
    schedulers: SchedulerFactory, cache_address: str, encoders: int = 1, **overrides: Any
) -> tuple[RunningScheduler, list[FakeEncoder], FakeWorker]:
    scheduler = await schedulers(encoder_cache_address=cache_address, **overrides)
    workers = [FakeEncoder(f"enc-{i}", cache_address) for i in range(encoders)]
    decoder = FakeWorker("dec-0")
    for worker in [*workers, decoder]:
        await worker.start(scheduler.address)
    await scheduler.wait_for(lambda: len(scheduler.core.registry.all()) == encoders + 1)
    return scheduler, workers, decoder


async def _stop(*workers: FakeWorker) -> None:
    for worker in workers:
        await worker.close()


def _item(identifier: str, data: bytes = b"\x00" * 12) -> common_pb2.MultiModalItem:
    return common_pb2.MultiModalItem(
        identifier=identifier, modality="image", offset=3, length=4, data=data, dtype="float32", shape=[3]
    )


async def test_miss_is_encoded_once_then_hits(schedulers: SchedulerFactory, cache_address: str) -> None:
    scheduler, (encoder,), decoder = await _mesh(schedulers, cache_address)
    try:
        same = [scheduler.route(PROMPT, mm_items=[_item("img-a")]) for _ in range(4)]
        routes = list(await asyncio.gather(*same))
        assert encoder.encoded == ["img-a"]  # four concurrent requests, one encode
        routes.append(await scheduler.route(PROMPT, mm_items=[_item("img-a")]))
        assert encoder.encoded == ["img-a"]  # cached: not encoded again
        assert all(r.worker_id == "dec-0" for r in routes)
        assert all(not item.data and not item.shape for r in routes for item in r.mm_items)
        assert all(r.mm_items[0].identifier == "img-a" and r.mm_items[0].length == 4 for r in routes)
    finally:
        await _stop(encoder, decoder)


async def test_bypass_encodes_every_request(schedulers: SchedulerFactory, cache_address: str) -> None:
    scheduler, (encoder,), decoder = await _mesh(schedulers, cache_address, bypass_encoder_cache=True)
    try:
        for _ in range(2):
            await scheduler.route(PROMPT, mm_items=[_item("img-b")])
        assert encoder.encoded == ["img-b", "img-b"]
    finally:
        await _stop(encoder, decoder)


async def test_force_encode_encodes_a_cached_item_again(
    schedulers: SchedulerFactory, cache_address: str
) -> None:
    scheduler, (encoder,), decoder = await _mesh(schedulers, cache_address)
    try:
        await scheduler.route(PROMPT, mm_items=[_item("img-c")])
        await scheduler.route(PROMPT, mm_items=[_item("img-c")])
        assert encoder.encoded == ["img-c"]
        # The decoder found the embeddings evicted: the gateway routes with force_encode.
        route = await scheduler.route(PROMPT, mm_items=[_item("img-c")], force_encode=True)
        assert encoder.encoded == ["img-c", "img-c"] and route.mm_items[0].identifier == "img-c"
    finally:
        await _stop(encoder, decoder)


async def test_unreachable_encoder_fails_over(schedulers: SchedulerFactory, cache_address: str) -> None:
    # round robin: enc-0 is tried first
    scheduler, encoders, decoder = await _mesh(
        schedulers, cache_address, encoders=2, routing_policy="round_robin"
    )
    try:
        encoders[0].fail_first = True
        await scheduler.route(PROMPT, mm_items=[_item("img-d")])
        assert encoders[0].calls == 1 and not encoders[0].encoded
        assert encoders[1].encoded == ["img-d"]
    finally:
        await _stop(*encoders, decoder)


async def test_clear_errors(schedulers: SchedulerFactory, cache_address: str) -> None:
    scheduler, (encoder,), decoder = await _mesh(schedulers, cache_address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as no_data:
            await scheduler.route(PROMPT, mm_items=[_item("img-e", data=b"")])
        assert no_data.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "carries no data" in (no_data.value.details() or "")
    finally:
        await _stop(encoder, decoder)
    with pytest.raises(grpc.aio.AioRpcError) as no_encoder:
        await scheduler.route(PROMPT, mm_items=[_item("img-f")])
    assert no_encoder.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_dead_encoder_cache_is_unavailable_fast(schedulers: SchedulerFactory) -> None:
    dead = f"127.0.0.1:{free_port()}"
    scheduler, (encoder,), decoder = await _mesh(schedulers, dead, encoder_cache_timeout_s=2.0)
    try:
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await scheduler.route(PROMPT, mm_items=[_item("img-g")])
        assert time.monotonic() - start < 5
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"encoder cache at {dead} is unavailable" in (failure.value.details() or "")
        assert not scheduler.lease_ids() and not encoder.encoded
    finally:
        await _stop(encoder, decoder)
