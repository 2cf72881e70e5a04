"""Encoder cache: LRU bound by bytes, chunked transfer over real gRPC, Redis metadata."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis

from encoder_cache_svc.config import EncoderCacheConfig
from encoder_cache_svc.servicer import META_KEY, EncoderCacheServicer, RedisMetadata
from encoder_cache_svc.store import EncoderCacheStore
from meshserve.v1 import encoder_cache_pb2, encoder_cache_pb2_grpc
from services.encoder_cache_client import CachedTensor
from services.redis_client import RedisServer
from services.server import GrpcServer


def _entry(identifier: str, n: int) -> CachedTensor:
    return CachedTensor(identifier, "float32", (n,), np.arange(n, dtype=np.float32).tobytes())


def test_lru_eviction_by_bytes() -> None:
    store = EncoderCacheStore(capacity_bytes=4 * 100)
    assert store.put(_entry("a", 40)) == []
    assert store.put(_entry("b", 40)) == []
    assert store.get("a") is not None  # a is now most recently used
    assert store.put(_entry("c", 40)) == ["b"]
    assert store.has("a") and store.has("c") and not store.has("b")
    assert store.stats.bytes_used == 4 * 80
    assert store.stats.evictions == 1


def test_rejects_inconsistent_or_oversized_items() -> None:
    store = EncoderCacheStore(capacity_bytes=64)
    with pytest.raises(ValueError, match="shape"):
        store.put(CachedTensor("x", "float32", (3,), b"\x00" * 8))
    with pytest.raises(ValueError, match="dtype"):
        store.put(CachedTensor("x", "complex", (1,), b"\x00" * 8))
    with pytest.raises(ValueError, match="capacity"):
        store.put(_entry("big", 100))
    assert store.stats.items == 0


@pytest.fixture
async def cache(
    redis_server: RedisServer,
) -> AsyncIterator[tuple[encoder_cache_pb2_grpc.EncoderCacheStub, str]]:
    config = EncoderCacheConfig(port=0, capacity_mb=1, chunk_bytes=64 * 1024, redis_url=redis_server.url)
    server = GrpcServer("encoder-cache-test", config)
    store = EncoderCacheStore(config.capacity_mb * 1024 * 1024)
    servicer = EncoderCacheServicer(
        store, RedisMetadata(redis_server.url, "shard-t", "addr"), config.chunk_bytes
    )
    server.add_service(
        "meshserve.v1.EncoderCache", encoder_cache_pb2_grpc.add_EncoderCacheServicer_to_server, servicer
    )
    port = await server.start()
    await server.set_serving(True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield encoder_cache_pb2_grpc.EncoderCacheStub(channel), redis_server.url
    await server.server.stop(0)


async def _put(stub: encoder_cache_pb2_grpc.EncoderCacheStub, identifier: str, array: np.ndarray) -> int:
    data = array.tobytes()
    meta = encoder_cache_pb2.TensorMeta(
        identifier=identifier, dtype=str(array.dtype), shape=list(array.shape), num_bytes=len(data)
    )

    async def chunks() -> AsyncIterator[encoder_cache_pb2.TensorChunk]:
        yield encoder_cache_pb2.TensorChunk(meta=meta, data=data[:50_000])
        for start in range(50_000, len(data), 50_000):
            yield encoder_cache_pb2.TensorChunk(data=data[start : start + 50_000])

    reply = await stub.Put(chunks())
    return int(reply.evicted)


async def _get(stub: encoder_cache_pb2_grpc.EncoderCacheStub, identifier: str) -> np.ndarray:
    meta, parts = None, []
    async for chunk in stub.Get(encoder_cache_pb2.GetRequest(identifier=identifier)):
        if chunk.HasField("meta"):
            meta = chunk.meta
        parts.append(chunk.data)
    assert meta is not None
    return np.frombuffer(b"".join(parts), dtype=meta.dtype).reshape(tuple(meta.shape))


async def test_put_get_roundtrip_chunked_and_metadata(
    cache: tuple[encoder_cache_pb2_grpc.EncoderCacheStub, str],
) -> None:
    stub, redis_url = cache
    array = np.random.default_rng(0).standard_normal((64, 1000)).astype(np.float32)  # 256 KB, several chunks
    assert await _put(stub, "img-1", array) == 0
    np.testing.assert_array_equal(await _get(stub, "img-1"), array)
    present = await stub.Has(encoder_cache_pb2.HasRequest(identifiers=["img-1", "nope"]))
    assert list(present.present) == [True, False]
    client = aioredis.Redis.from_url(redis_url)
    meta = await client.hgetall(META_KEY + "img-1")
    assert meta[b"shape"] == b"[64, 1000]" and meta[b"shard"] == b"shard-t"
    await client.aclose()


async def test_eviction_over_grpc_and_errors(
    cache: tuple[encoder_cache_pb2_grpc.EncoderCacheStub, str],
) -> None:
    stub, redis_url = cache
    block = np.zeros((100_000,), dtype=np.float32)  # 400 KB; capacity is 1 MiB
    evicted = [await _put(stub, f"e{i}", block) for i in range(4)]
    assert sum(evicted) >= 1
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await _get(stub, "e0")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    client = aioredis.Redis.from_url(redis_url)
    assert not await client.exists(META_KEY + "e0")
    await client.aclose()
    bad = encoder_cache_pb2.TensorMeta(identifier="bad", dtype="float32", shape=[10], num_bytes=8)

    async def chunks() -> AsyncIterator[encoder_cache_pb2.TensorChunk]:
        yield encoder_cache_pb2.TensorChunk(meta=bad, data=b"\x00" * 8)

    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        await stub.Put(chunks())
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shape" in (invalid.value.details() or "")
