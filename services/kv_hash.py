"""The one KV-cache block hash scheme of meshserve.

Workers hash the full blocks they keep in their prefix cache and publish the hashes
(``KvEvent``); the global scheduler hashes incoming prompts with the same functions
to route a request to the worker that already holds the longest prefix. Both sides
must therefore agree bit for bit, which is why the scheme lives here, in pure Python
with no torch dependency.

Scheme ``sha256-64``
--------------------
A block is ``block_size`` consecutive token ids. Its hash is chained on the hash of the
block before it, so equal hashes mean equal *prefixes*, not only equal blocks::

    h_0 = hash_block(None, tokens[0:B], extra_keys)
    h_i = hash_block(h_{i-1}, tokens[i*B:(i+1)*B], extra_keys)

``hash_block`` is the first 8 bytes (big endian, unsigned) of SHA-256 over this byte
string (all integers big endian)::

    b"MSKV1"                                   domain tag / format version
    u64  parent hash, or KV_HASH_SEED for the first block
    u32  number of tokens, then u32 per token id
    u32  number of extra keys, then per key: u32 byte length + UTF-8 bytes

``extra_keys`` are strings that change what a block's KV means without changing its
token ids: a cache salt (tenant isolation), LoRA name, multimodal content hashes. They
are mixed into every block of the request. Only full blocks are ever hashed; a partial
tail block is never shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["KV_HASH_ALGO", "KV_HASH_SEED", "block_hashes", "hash_block"]

KV_HASH_ALGO = "sha256-64"
# First 8 bytes of sha256(b"meshserve/kv-hash/v1"): the "parent" of every first block.
KV_HASH_SEED = 16049160656863714000

_TAG = b"MSKV1"
_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF


def hash_block(parent: int | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> int:
    """Hash one block chained on ``parent`` (None for the first block); returns a uint64."""
    if not token_ids:  # block_hashes has no block of size 0
        return _chain(parent, b"", 0, 1, _keys_suffix(extra_keys))[0]
    return block_hashes(token_ids, len(token_ids), extra_keys, parent)[0]


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...] = (), parent: int | None = None
) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids`` (a partial tail is skipped),
    the first one chained on ``parent`` (None: ``token_ids`` starts the sequence).

    One pass: the tokens are packed once for all blocks and the constant suffix (extra
    keys) built once -- the scheduler hashes every prompt it routes with this."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    count = len(token_ids) // block_size
    if count == 0:
        return []
    try:
        packed = struct.pack(f">{count * block_size}I", *token_ids[: count * block_size])
    except struct.error as exc:
        raise ValueError(f"token_ids must be ints in [0, {_U32_MAX}]: {exc}") from exc
    return _chain(parent, packed, block_size, count, _keys_suffix(extra_keys))


def _chain(parent: int | None, packed: bytes, block_size: int, count: int, suffix: bytes) -> list[int]:
    """The chained hashes of ``count`` blocks of ``block_size`` packed token ids."""
    chain = KV_HASH_SEED if parent is None else parent
    if not 0 <= chain <= _U64_MAX:
        raise ValueError(f"parent hash must be a uint64, got {parent}")
    length = struct.pack(">I", block_size)
    step = 4 * block_size
    sha256, to_int, pack_parent = hashlib.sha256, int.from_bytes, struct.Struct(">Q").pack
    hashes: list[int] = []
    for index in range(count):
        block = packed[index * step : (index + 1) * step]
        digest = sha256(b"".join((_TAG, pack_parent(chain), length, block, suffix)))
        chain = to_int(digest.digest()[:8], "big")
        hashes.append(chain)
    return hashes


def _keys_suffix(extra_keys: tuple[str, ...]) -> bytes:
    """The encoded extra keys every block's input ends with."""
    parts = [struct.pack(">I", len(extra_keys))]
    for key in extra_keys:
        if not isinstance(key, str):
            raise ValueError(f"extra_keys must be strings, got {type(key).__name__}")
        raw = key.encode("utf-8")
        parts.append(struct.pack(">I", len(raw)))
        parts.append(raw)
    return b"".join(parts)
