"""The scheduler's fast prompt hashing equals the workers' contract (services.kv_hash)."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.block_hashing import prompt_block_hashes
from services.kv_hash import block_hashes


@pytest.mark.parametrize(
    ("length", "block_size", "keys"),
    [
        (0, 16, ()),
        (15, 16, ()),
        (16, 16, ()),
        (1800, 16, ()),
        (37, 16, ("salt:x", "mm:abc")),
        (70, 8, ("é",)),
    ],
)
def test_equals_the_contract(length: int, block_size: int, keys: tuple[str, ...]) -> None:
    rng = random.Random(length)
    tokens = [rng.randrange(0, 2**32) for _ in range(length)]
    assert prompt_block_hashes(tokens, block_size, keys) == block_hashes(tokens, block_size, keys)


def test_rejects_what_the_contract_rejects() -> None:
    with pytest.raises(ValueError, match="token_ids"):
        prompt_block_hashes([2**32] * 16, 16)
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes([1] * 16, 0)
    with pytest.raises(ValueError, match="extra_keys"):
        prompt_block_hashes([1] * 16, 16, (3,))  # type: ignore[arg-type]
