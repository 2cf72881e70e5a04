"""Encoder cache configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.config import ServerConfig


@dataclass(frozen=True)
class EncoderCacheConfig(ServerConfig):
    """Bounded in-memory tensor store; metadata mirrored to Redis when configured."""

    port: int = 50070
    capacity_mb: int = 1024
    # Exact capacity in bytes, overriding capacity_mb when > 0 (small caches in tests and benchmarks).
    capacity_bytes: int = 0
    chunk_bytes: int = 1024 * 1024
    redis_url: str = ""
    # Address other services reach this shard at (recorded in Redis metadata).
    advertise_address: str = ""
    shard_id: str = "encoder-cache-0"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity_mb <= 0:
            raise ValueError("capacity_mb must be > 0")
        if self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        if self.capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")

    @property
    def capacity(self) -> int:
        """The store's capacity in bytes."""
        return self.capacity_bytes or self.capacity_mb * 1024 * 1024
