"""BlockManager: allocation, ref counts, LRU eviction, hash chain, KV events (no model)."""

from __future__ import annotations

import pytest

from services.kv_hash import block_hashes
from worker_svc.engine.block_manager import BlockManager, KvEvent
from worker_svc.engine.request import Request
from worker_svc.engine.sampling import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], **params: object) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params))  # type: ignore[arg-type]


def compute(bm: BlockManager, r: Request, n: int | None = None) -> None:
    """Pretend the model computed the allocated tokens."""
    r.num_computed_tokens = r.num_tokens if n is None else n
    bm.mark_computed(r)


def test_allocate_append_free_refcounts() -> None:
    bm = BlockManager(8, BS)
    r = req("a", list(range(10)))
    assert bm.allocate(r, 10)
    assert len(r.block_table) == 3 and bm.num_used_blocks() == 3
    compute(bm, r)
    r.output_token_ids.append(99)
    assert bm.append_slots(r, 1)  # token 11 still fits in block 3
    assert len(r.block_table) == 3
    compute(bm, r)
    r.output_token_ids.append(98)
    r.output_token_ids.append(97)
    assert bm.append_slots(r, 2)  # positions 11, 12 -> needs a 4th block
    assert len(r.block_table) == 4
    bm.free(r)
    assert bm.num_used_blocks() == 0 and r.block_table == []
    assert bm.num_free_blocks() == 8


def test_prefix_hit_shares_blocks_and_hash_chain() -> None:
    bm = BlockManager(16, BS)
    a = req("a", list(range(12)))
    assert bm.allocate(a, 12)
    compute(bm, a)
    assert a.block_hashes[:3] == block_hashes(list(range(12)), BS)
    b = req("b", [*range(8), 50, 51, 52, 53, 54])
    assert bm.num_cached_prefix_tokens(b) == 8
    assert bm.allocate(b, b.num_tokens - 8)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1
    bm.free(b)
    assert bm.num_used_blocks() == 0
    assert bm.prefix_hit_tokens == 8 and bm.prefix_queried_tokens == 12 + 13


def test_never_hits_entire_prompt() -> None:
    bm = BlockManager(16, BS)
    a = req("a", list(range(8)))
    assert bm.allocate(a, 8)
    compute(bm, a)
    bm.free(a)
    same = req("same", list(range(8)))  # exact multiple of BS, fully cached
    # (8 - 1) // 4 = 1 block may hit: the last block is recomputed into a private block.
    assert bm.num_cached_prefix_tokens(same) == 4
    assert bm.allocate(same, 4)
    assert bm.blocks[same.block_table[1]].block_hash is None
    bm.free(same)


def test_lru_eviction_order_and_events() -> None:
    events: list[KvEvent] = []
    bm = BlockManager(4, BS, on_event=events.extend)
    a = req("a", list(range(8)))  # 2 blocks
    assert bm.allocate(a, 8)
    compute(bm, a)
    bm.flush_events()
    assert [e.kind for e in events] == ["stored"]
    stored = events[0]
    assert stored.block_hashes == block_hashes(list(range(8)), BS)
    assert stored.parent_hash is None and stored.token_ids == list(range(8))
    bm.free(a)  # cached blocks go to the tail, a's last block first in line for eviction
    events.clear()
    b = req("b", [100 + i for i in range(12)])  # needs 3 of the 4 blocks: 2 free + evict 1
    assert bm.allocate(b, 12)
    bm.flush_events()
    assert [e.kind for e in events] == ["removed"]
    assert events[0].block_hashes == [stored.block_hashes[1]]  # tail block evicted first
    # a's first block survives and is still a hit.
    again = req("again", [*range(4), 7, 7])
    assert bm.num_cached_prefix_tokens(again) == 4
    bm.free(b)


def test_allocate_failure_has_no_side_effects() -> None:
    bm = BlockManager(2, BS)
    big = req("big", list(range(12)))
    assert not bm.can_allocate(big, 12)
    assert not bm.allocate(big, 12)
    assert big.block_table == [] and bm.num_used_blocks() == 0
    small = req("small", list(range(5)))
    assert bm.allocate(small, 5)
    compute(bm, small)
    assert not bm.append_slots(small, 4)  # positions 5..8 would need a 3rd block
    assert len(small.block_table) == 2
    bm.free(small)


def test_partial_blocks_are_not_cached_and_stored_parent_chain() -> None:
    events: list[KvEvent] = []
    bm = BlockManager(8, BS, on_event=events.extend)
    r = req("r", list(range(6)))
    assert bm.allocate(r, 6)
    compute(bm, r)
    assert bm.num_cached_blocks() == 1  # block 2 holds only 2 tokens
    for tok in (6, 7):
        r.output_token_ids.append(tok)
        assert bm.append_slots(r, 1)
        compute(bm, r, r.num_tokens)
    bm.flush_events()
    assert [e.kind for e in events] == ["stored", "stored"]
    assert events[1].parent_hash == events[0].block_hashes[0]
    assert events[1].token_ids == [4, 5, 6, 7]
    bm.free(r)


def test_extra_keys_and_prompt_logprobs_isolate_cache() -> None:
    bm = BlockManager(16, BS)
    a = req("a", list(range(9)))
    assert bm.allocate(a, 9)
    compute(bm, a)
    salted = Request("s", list(range(9)), SamplingParams(), extra_keys=("salt:x",))
    assert bm.num_cached_prefix_tokens(salted) == 0
    wants_plp = req("p", list(range(9)), prompt_logprobs=1)
    assert bm.num_cached_prefix_tokens(wants_plp) == 0
    assert bm.num_cached_prefix_tokens(req("plain", list(range(9)))) == 8
    bm.free(a)


def test_reset_prefix_cache() -> None:
    events: list[KvEvent] = []
    bm = BlockManager(8, BS, on_event=events.extend)
    a = req("a", list(range(8)))
    assert bm.allocate(a, 8)
    compute(bm, a)
    assert not bm.reset_prefix_cache()  # blocks in use
    bm.free(a)
    assert bm.reset_prefix_cache()
    bm.flush_events()
    assert events[-1].kind == "cleared"
    assert bm.num_cached_blocks() == 0


def test_double_free_detected() -> None:
    bm = BlockManager(4, BS)
    r = req("r", [1, 2, 3])
    assert bm.allocate(r, 3)
    table = list(r.block_table)
    bm.free(r)
    r.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(r)
