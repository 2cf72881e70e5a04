"""services.kv_hash: the block hash scheme shared by workers and the global scheduler."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from services.kv_hash import KV_HASH_ALGO, KV_HASH_SEED, block_hashes, hash_block


def test_constants() -> None:
    assert KV_HASH_ALGO == "sha256-64"
    assert KV_HASH_SEED == int.from_bytes(hashlib.sha256(b"meshserve/kv-hash/v1").digest()[:8], "big")


def test_canonical_encoding_is_documented_one() -> None:
    payload = b"MSKV1" + struct.pack(">QI", KV_HASH_SEED, 3) + struct.pack(">3I", 5, 6, 7)
    payload += struct.pack(">I", 1) + struct.pack(">I", 6) + b"salt:x"
    expected = int.from_bytes(hashlib.sha256(payload).digest()[:8], "big")
    assert hash_block(None, [5, 6, 7], ("salt:x",)) == expected


def test_chain_and_full_blocks_only() -> None:
    toks = list(range(10, 30))  # 20 tokens, block 8 -> 2 full blocks
    hs = block_hashes(toks, 8)
    assert len(hs) == 2
    assert hs[0] == hash_block(None, toks[:8])
    assert hs[1] == hash_block(hs[0], toks[8:16])
    assert all(0 <= h < 2**64 for h in hs)
    # Chained: same second block after a different first block hashes differently.
    other = block_hashes([1] * 8 + toks[8:16], 8)
    assert other[1] != hs[1]
    # Prefix property.
    assert block_hashes(toks[:16], 8) == hs
    assert block_hashes(toks[:7], 8) == []


def test_extra_keys_change_every_block() -> None:
    toks = list(range(32))
    plain = block_hashes(toks, 16)
    salted = block_hashes(toks, 16, ("salt:a",))
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert block_hashes(toks, 16, ("salt:a",)) == salted
    # Key boundaries are length-prefixed: ("ab",) != ("a", "b").
    assert hash_block(None, toks[:16], ("ab",)) != hash_block(None, toks[:16], ("a", "b"))


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="token_ids"):
        hash_block(None, [-1])
    with pytest.raises(ValueError, match="parent"):
        hash_block(-5, [1])
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)


def _spec_block(parent: int, tokens: list[int], keys: tuple[str, ...]) -> int:
    """One block hashed straight from the scheme in services.kv_hash's docstring."""
    payload = b"MSKV1" + struct.pack(">QI", parent, len(tokens)) + struct.pack(f">{len(tokens)}I", *tokens)
    payload += struct.pack(">I", len(keys))
    for key in keys:
        payload += struct.pack(">I", len(key.encode())) + key.encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "big")


@pytest.mark.parametrize(
    ("length", "block_size", "keys"),
    [
        (0, 16, ()),
        (15, 16, ()),
        (16, 16, ()),
        (1800, 16, ()),
        (37, 16, ("salt:x", "mm:abc")),
        (70, 8, ("é",)),
        (64, 16, ("lora:sql", "mm:0f3a")),
    ],
)
def test_one_pass_equals_the_scheme_block_by_block(
    length: int, block_size: int, keys: tuple[str, ...]
) -> None:
    rng = random.Random(length)
    tokens = [rng.randrange(0, 2**32) for _ in range(length)]
    expected, parent = [], KV_HASH_SEED
    for start in range(0, length - block_size + 1, block_size):
        parent = _spec_block(parent, tokens[start : start + block_size], keys)
        expected.append(parent)
    assert block_hashes(tokens, block_size, keys) == expected
    # A chain continued from a parent (the engine hashes blocks as they fill) is the same chain.
    if len(expected) >= 2:
        assert block_hashes(tokens[block_size:], block_size, keys, parent=expected[0]) == expected[1:]


def test_one_pass_rejects_what_the_scheme_rejects() -> None:
    with pytest.raises(ValueError, match="token_ids"):
        block_hashes([2**32] * 16, 16)
    with pytest.raises(ValueError, match="extra_keys"):
        block_hashes([1] * 16, 16, (3,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parent"):
        block_hashes([1] * 16, 16, parent=2**64)
