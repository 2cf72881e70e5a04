"""What a KV hand-off between two engines carries and how the receiver checks it.

Prefill/decode disaggregation moves a prompt's KV blocks from a prefill engine to a
decode engine. A block is used by the receiver only when everything below matches:

* the ``KvLayout`` (model, dtype, layers, KV heads, head dim, block size): the bytes of a
  block mean the same on both sides;
* its checksum (CRC-32 of its bytes, taken by the sender as it reads the block): the
  bytes arrived as they left;
* its block hash equals the receiver's own hash of the same prompt block
  (``services.kv_hash`` with the request's extra keys): the block is KV of *this* prompt.

Anything else raises :class:`KvTransferError` naming the reason, and the receiver computes
the prompt itself. No torch and no grpc here.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, fields

__all__ = [
    "FALLBACK_REASONS",
    "KvBlockPayload",
    "KvLayout",
    "KvTransferError",
    "block_checksum",
    "verify_checksums",
]

# Why a decode worker prefilled a prompt itself instead of using a prefill worker's KV:
# the `reason` label of meshserve_worker_kv_transfer_fallbacks_total.
FALLBACK_REASONS = ("unavailable", "timeout", "layout", "checksum", "hash", "import", "error")


class KvTransferError(Exception):
    """A hand-off that cannot be used; ``reason`` is one of ``FALLBACK_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in FALLBACK_REASONS:
            raise ValueError(f"unknown KV transfer failure reason {reason!r}")
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class KvLayout:
    """The shape and meaning of one KV block: per layer, K and V of ``block_size`` tokens,
    ``num_kv_heads`` x ``head_dim`` values of ``dtype`` each (layout [layer, k/v, token,
    head, dim], contiguous)."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def element_size(self) -> int:
        """Bytes per value of ``dtype``."""
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size
        return per_token * self.block_size

    def mismatch(self, other: KvLayout) -> str | None:
        """The first field on which ``other`` differs (``"field: ours != theirs"``), or None."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                return f"{f.name}: {mine!r} != {theirs!r}"
        return None


@dataclass(frozen=True)
class KvBlockPayload:
    """One block on the wire: its index in the prompt, hash, bytes and checksum."""

    index: int
    block_hash: int
    data: bytes
    checksum: int


def block_checksum(data: bytes) -> int:
    """CRC-32 of a block's bytes (zlib's: in the standard library, ~GB/s)."""
    return zlib.crc32(data)


def verify_checksums(payloads: Iterable[KvBlockPayload]) -> None:
    """KvTransferError("checksum") naming the first block whose bytes changed on the way."""
    for payload in payloads:
        if block_checksum(payload.data) != payload.checksum:
            raise KvTransferError("checksum", f"block {payload.index}: checksum mismatch")
