"""Encoder cache configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.config import DEFAULT_PORTS, ServerConfig, at_least, opt, positive


@dataclass(frozen=True)
class EncoderCacheConfig(ServerConfig):
    """Bounded in-memory tensor store; metadata mirrored to Redis when configured."""

    port: int = opt(DEFAULT_PORTS["encoder-cache"], "the gRPC port")
    capacity_mb: int = opt(1024, "the store's capacity in MiB")
    capacity_bytes: int = opt(
        0, "exact capacity in bytes, overriding --capacity-mb when > 0 (small caches in tests and benchmarks)"
    )
    chunk_bytes: int = opt(1024 * 1024, "bytes per streamed chunk of a stored tensor")
    redis_url: str = opt("", "Redis the metadata is mirrored to (empty: none)")
    advertise_address: str = opt(
        "", "the address other services reach this shard at (recorded in Redis metadata)"
    )
    shard_id: str = opt("encoder-cache-0", "this shard's name in Redis metadata")

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "capacity_mb")
        positive(self, "chunk_bytes")
        at_least(self, 0, "capacity_bytes")

    @property
    def capacity(self) -> int:
        """The store's capacity in bytes."""
        return self.capacity_bytes or self.capacity_mb * 1024 * 1024
