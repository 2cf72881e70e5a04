"""Client of the encoder cache (meshserve.v1.EncoderCache), shared by the scheduler
(`has`), the encoder workers (`put`) and the decoder workers (`get`).

Every call has a deadline, so a cache that is down or unreachable turns into a clear
`Unavailable` ("encoder cache at HOST:PORT is unavailable ...") within `timeout_s`,
never a hang. Entries are keyed by `cache_key(model, identifier)`: an image's
embeddings depend on the model that encoded it, so two models never share them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from meshserve.v1 import encoder_cache_pb2, encoder_cache_pb2_grpc
from services.config import MAX_MESSAGE_BYTES
from services.errors import Code, MeshError, Unavailable
from services.rpc import PEER_LOST, error_from_rpc, open_channel

log = logging.getLogger(__name__)

_UNREACHABLE = PEER_LOST | {grpc.StatusCode.DEADLINE_EXCEEDED}


class EmbeddingsMissing(MeshError):
    """An item's embeddings are not (or no longer) in the encoder cache: encode it again."""

    code = Code.FAILED_PRECONDITION


def cache_key(model: str, identifier: str) -> str:
    """The cache entry of an item's embeddings for one served model."""
    return f"{model}/{identifier}" if model else identifier


@dataclass(frozen=True)
class CachedTensor:
    """A tensor as the cache stores it: raw bytes plus dtype name and shape."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes = field(repr=False)

    @property
    def num_bytes(self) -> int:
        """The size of its data."""
        return len(self.data)


def tensor_chunks(tensor: CachedTensor, chunk_bytes: int) -> Iterator[encoder_cache_pb2.TensorChunk]:
    """`tensor` as the Put and Get streams carry it: its meta with the first `chunk_bytes`
    of its data, then the rest in pieces of at most `chunk_bytes`."""
    meta = encoder_cache_pb2.TensorMeta(
        identifier=tensor.key, dtype=tensor.dtype, shape=list(tensor.shape), num_bytes=tensor.num_bytes
    )
    yield encoder_cache_pb2.TensorChunk(meta=meta, data=tensor.data[:chunk_bytes])
    for start in range(chunk_bytes, tensor.num_bytes, chunk_bytes):
        yield encoder_cache_pb2.TensorChunk(data=tensor.data[start : start + chunk_bytes])


class EncoderCacheClient:
    """Has / Put / Get with deadlines; transport failures raise `Unavailable`."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        chunk_bytes: int = 1024 * 1024,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        if not address:
            raise ValueError("encoder cache address is empty")
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._channel = open_channel(address, max_message_bytes)
        self._stub = encoder_cache_pb2_grpc.EncoderCacheStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    def _error(self, exc: grpc.aio.AioRpcError, what: str) -> MeshError:
        if exc.code() in _UNREACHABLE:
            return Unavailable(
                f"encoder cache at {self.address} is unavailable ({what}: "
                f"{exc.code().name}: {exc.details() or 'no details'})"
            )
        return error_from_rpc(exc)

    async def has(self, keys: Sequence[str]) -> list[bool]:
        """Which of `keys` are cached (no LRU touch)."""
        try:
            reply = await self._stub.Has(
                encoder_cache_pb2.HasRequest(identifiers=list(keys)), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, "Has") from exc
        if len(reply.present) != len(keys):
            raise Unavailable(f"encoder cache at {self.address} answered Has with {len(reply.present)} flags")
        return list(reply.present)

    async def put(self, tensor: CachedTensor) -> int:
        """Stores `tensor`; returns how many entries the cache evicted to make room."""
        try:
            reply = await self._stub.Put(tensor_chunks(tensor, self.chunk_bytes), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, "Put") from exc
        return int(reply.evicted)

    async def get(self, key: str) -> CachedTensor | None:
        """The cached tensor, or None when the cache does not hold `key`."""
        meta: encoder_cache_pb2.TensorMeta | None = None
        parts: list[bytes] = []
        try:
            async for chunk in self._stub.Get(
                encoder_cache_pb2.GetRequest(identifier=key), timeout=self.timeout_s
            ):
                if meta is None:
                    meta = chunk.meta
                parts.append(chunk.data)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise self._error(exc, "Get") from exc
        if meta is None:
            raise Unavailable(f"encoder cache at {self.address} returned no data for {key!r}")
        data = b"".join(parts)
        if len(data) != meta.num_bytes:
            raise Unavailable(
                f"encoder cache at {self.address} returned {len(data)} of {meta.num_bytes} bytes"
            )
        return CachedTensor(key, meta.dtype, tuple(meta.shape), data)
