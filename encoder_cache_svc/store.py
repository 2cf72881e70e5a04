"""The cache itself: an LRU map identifier → tensor bytes bounded by total bytes.
Pure domain code (no grpc, no Redis)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from services.encoder_cache_client import CachedTensor

# dtypes a tensor may be stored with, and their item sizes.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_used: int = 0
    items: int = 0


def validate_entry(identifier: str, dtype: str, shape: tuple[int, ...], num_bytes: int) -> None:
    """Raises ValueError naming the field when the metadata is inconsistent."""
    if not identifier or len(identifier) > 256:
        raise ValueError("identifier must be 1..256 characters")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
    if any(d < 0 for d in shape):
        raise ValueError("shape must not have negative dimensions")
    expected = DTYPE_SIZES[dtype]
    for d in shape:
        expected *= d
    if expected != num_bytes:
        raise ValueError(
            f"data has {num_bytes} bytes but dtype {dtype} and shape {list(shape)} need {expected}"
        )


class EncoderCacheStore:
    """LRU store bounded by `capacity_bytes`; an item larger than the capacity is refused."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, CachedTensor] = OrderedDict()
        self.stats = StoreStats()

    def has(self, identifier: str) -> bool:
        return identifier in self._items

    def get(self, identifier: str) -> CachedTensor | None:
        entry = self._items.get(identifier)
        if entry is None:
            self.stats.misses += 1
            return None
        self._items.move_to_end(identifier)
        self.stats.hits += 1
        return entry

    def put(self, entry: CachedTensor) -> list[str]:
        """Stores `entry` under its key, the item's identifier (replacing an older one),
        and returns the evicted identifiers."""
        validate_entry(entry.key, entry.dtype, entry.shape, entry.num_bytes)
        if entry.num_bytes > self.capacity_bytes:
            raise ValueError(
                f"item of {entry.num_bytes} bytes exceeds the cache capacity {self.capacity_bytes}"
            )
        self._remove(entry.key)
        evicted: list[str] = []
        while self.stats.bytes_used + entry.num_bytes > self.capacity_bytes:
            old_id, _ = next(iter(self._items.items()))
            self._remove(old_id)
            self.stats.evictions += 1
            evicted.append(old_id)
        self._items[entry.key] = entry
        self.stats.bytes_used += entry.num_bytes
        self.stats.items = len(self._items)
        return evicted

    def _remove(self, identifier: str) -> None:
        old = self._items.pop(identifier, None)
        if old is not None:
            self.stats.bytes_used -= old.num_bytes
            self.stats.items = len(self._items)
