"""Decoder side of E/PD disaggregation: fetch each multimodal item's embeddings from the
encoder cache by identifier and hand them to the engine as `MultiModalInput`s.

The decoder never runs a vision tower: an item whose embeddings are not cached fails the
request with FAILED_PRECONDITION (`EmbeddingsMissing`), which tells the scheduler to
encode it again and retry; a cache that is down fails it with UNAVAILABLE within the
client's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from meshserve.v1 import common_pb2
from services.encoder_cache_client import CachedTensor, EmbeddingsMissing, EncoderCacheClient, cache_key
from services.errors import InvalidArgument
from worker_svc.encoder import tensor_from_bytes
from worker_svc.engine.multimodal import MultiModalInput


class EmbeddingFetcher:
    """`GenerateRequest.mm_items` → engine `MultiModalInput`s, fetched from the encoder cache.

    The embeddings are handed over in the dtype the cache holds them in, on the CPU: the
    engine moves them to its dtype and device on its own thread when it merges them
    (`multimodal.merge_mm_rows`). A conversion here, on the event loop's thread, would be
    a parallel region there, and an OpenMP pool left on a second long-lived thread slows
    every forward after it (async_engine._build_on_own_thread)."""

    def __init__(self, cache: EncoderCacheClient, model: str, hidden_size: int) -> None:
        self.cache = cache
        self.model = model
        self.hidden_size = hidden_size

    async def fetch(self, items: Sequence[common_pb2.MultiModalItem]) -> list[MultiModalInput]:
        """Embeddings of every item, in order (one cache read per distinct identifier)."""
        if not items:
            return []
        identifiers = list(dict.fromkeys(item.identifier for item in items))
        found = await asyncio.gather(*(self.cache.get(cache_key(self.model, i)) for i in identifiers))
        tensors = dict(zip(identifiers, found, strict=True))
        return [self._input(i, item, tensors[item.identifier]) for i, item in enumerate(items)]

    def _input(
        self, index: int, item: common_pb2.MultiModalItem, cached: CachedTensor | None
    ) -> MultiModalInput:
        name = f"mm_items[{index}] ({item.identifier})"
        if cached is None:
            raise EmbeddingsMissing(f"{name}: embeddings are not in the encoder cache", param="mm_items")
        expected = (item.length, self.hidden_size)
        if cached.shape != expected:
            raise InvalidArgument(
                f"{name}: cached embeddings have shape {list(cached.shape)}, expected {list(expected)}",
                param="mm_items",
            )
        tensor = tensor_from_bytes(cached.dtype, cached.shape, cached.data)
        return MultiModalInput(item.identifier, item.offset, item.length, tensor)
