"""EncoderCache gRPC servicer: a thin layer over EncoderCacheStore, with metadata
(identifier → shard address, dtype, shape, size) mirrored in Redis."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from encoder_cache_svc.store import EncoderCacheStore, validate_entry
from meshserve.v1 import encoder_cache_pb2, encoder_cache_pb2_grpc
from services.encoder_cache_client import CachedTensor, tensor_chunks
from services.errors import InvalidArgument, NotFound
from services.redis_client import KEY_PREFIX, connect
from services.rpc import rpc_handler

log = logging.getLogger(__name__)

HITS = Counter("meshserve_encoder_cache_hits_total", "Encoder cache lookups that found the item")
MISSES = Counter("meshserve_encoder_cache_misses_total", "Encoder cache lookups that missed")
EVICTIONS = Counter("meshserve_encoder_cache_evictions_total", "Items evicted to stay under capacity")
BYTES = Gauge("meshserve_encoder_cache_bytes", "Bytes held by the encoder cache")
ITEMS = Gauge("meshserve_encoder_cache_items", "Items held by the encoder cache")

META_KEY = KEY_PREFIX + "encoder-cache:"


class RedisMetadata:
    """Best-effort mirror of the store's index in Redis (serving never depends on it)."""

    def __init__(self, url: str, shard_id: str, address: str) -> None:
        self._redis = connect(url) if url else None
        self._shard = shard_id
        self._address = address

    async def stored(self, entry: CachedTensor, evicted: list[str]) -> None:
        if self._redis is None:
            return
        meta: dict[str, str | int] = {
            "shard": self._shard,
            "address": self._address,
            "dtype": entry.dtype,
            "shape": json.dumps(list(entry.shape)),
            "bytes": entry.num_bytes,
        }
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(META_KEY + entry.key, mapping=meta)  # type: ignore[arg-type]
                for identifier in evicted:
                    pipe.delete(META_KEY + identifier)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("redis metadata update failed: %s", exc)


class EncoderCacheServicer(encoder_cache_pb2_grpc.EncoderCacheServicer):
    """Has / Put (client-streamed chunks) / Get (server-streamed chunks)."""

    def __init__(self, store: EncoderCacheStore, metadata: RedisMetadata, chunk_bytes: int) -> None:
        self.store = store
        self.metadata = metadata
        self.chunk_bytes = chunk_bytes

    @rpc_handler
    async def Has(
        self, request: encoder_cache_pb2.HasRequest, context: grpc.aio.ServicerContext
    ) -> encoder_cache_pb2.HasResponse:
        """Which identifiers are present (no LRU touch, no hit/miss accounting)."""
        return encoder_cache_pb2.HasResponse(present=[self.store.has(i) for i in request.identifiers])

    async def Put(
        self,
        request_iterator: AsyncIterator[encoder_cache_pb2.TensorChunk],
        context: grpc.aio.ServicerContext,
    ) -> encoder_cache_pb2.PutResponse:
        """Stores one tensor; the first chunk carries `meta`, the rest only data."""
        return await self._put(request_iterator, context)

    @rpc_handler
    async def _put(
        self,
        request_iterator: AsyncIterator[encoder_cache_pb2.TensorChunk],
        context: grpc.aio.ServicerContext,
    ) -> encoder_cache_pb2.PutResponse:
        meta: encoder_cache_pb2.TensorMeta | None = None
        parts: list[bytes] = []
        size = 0
        async for chunk in request_iterator:
            if meta is None:
                if not chunk.HasField("meta"):
                    raise InvalidArgument("the first chunk must carry meta", param="meta")
                meta = chunk.meta
                validate_entry(meta.identifier, meta.dtype, tuple(meta.shape), meta.num_bytes)
                # Refuse before buffering: otherwise a client streams up to num_bytes into memory.
                if meta.num_bytes > self.store.capacity_bytes:
                    raise InvalidArgument(
                        f"item of {meta.num_bytes} bytes exceeds the cache capacity {self.store.capacity_bytes}",
                        param="meta.num_bytes",
                    )
            size += len(chunk.data)
            if size > meta.num_bytes:
                raise InvalidArgument(f"more data than meta.num_bytes={meta.num_bytes}", param="data")
            parts.append(chunk.data)
        if meta is None:
            raise InvalidArgument("empty Put stream", param="meta")
        entry = CachedTensor(meta.identifier, meta.dtype, tuple(meta.shape), b"".join(parts))
        evicted = self.store.put(entry)
        EVICTIONS.inc(len(evicted))
        self._gauges()
        await self.metadata.stored(entry, evicted)
        return encoder_cache_pb2.PutResponse(stored=True, evicted=len(evicted))

    @rpc_handler
    async def Get(
        self, request: encoder_cache_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[encoder_cache_pb2.TensorChunk]:
        """Streams the tensor in chunks of at most `chunk_bytes`; NOT_FOUND when absent."""
        entry = self.store.get(request.identifier)
        if entry is None:
            MISSES.inc()
            raise NotFound(f"identifier {request.identifier!r} is not cached", param="identifier")
        HITS.inc()
        for chunk in tensor_chunks(entry, self.chunk_bytes):
            yield chunk

    def _gauges(self) -> None:
        BYTES.set(self.store.stats.bytes_used)
        ITEMS.set(self.store.stats.items)
