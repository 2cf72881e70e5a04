"""The KV tier (worker_svc/engine/kv_tier.py): admission after repeated use (uses before an
earlier eviction count), frequency-aware eviction, checksums; and in the engine (fp32,
greedy): a prefix evicted from the cache comes back from the tier as cached tokens with
outputs equal to an engine without a tier, and a corrupt tier block is computed again."""

from __future__ import annotations

from collections.abc import Callable

from tests.worker_engine.conftest import prompts, run_all, tokens
from worker_svc.engine import LLMEngine, SamplingParams
from worker_svc.engine.block_manager import BlockManager
from worker_svc.engine.kv_tier import KvTier
from worker_svc.engine.request import Request

Factory = Callable[..., LLMEngine]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class Blocks:
    """A stand-in KV cache of byte blocks, for the tier's read/write functions."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.data: dict[int, bytes] = {}

    def read(self, block_id: int) -> bytes:
        return self.data.get(block_id, bytes([block_id % 256]) * self.size)

    def write(self, block_id: int, data: bytes) -> None:
        self.data[block_id] = data


def _tier(capacity: int, admit_after: int = 2) -> tuple[KvTier, Blocks]:
    blocks = Blocks()
    return KvTier(capacity, blocks.size, blocks.read, blocks.write, admit_after), blocks


def test_admission_counts_uses_across_evictions() -> None:
    tier, _ = _tier(4)
    tier.evicted(101, block_id=1, uses=1)  # once: remembered, not stored
    assert 101 not in tier
    tier.evicted(101, block_id=1, uses=1)  # computed again and evicted: two uses in all
    assert 101 in tier and tier.read(101) == bytes([1]) * 8
    tier.evicted(202, block_id=2, uses=2)
    assert 202 in tier and tier.stats.stored_blocks == 2


def test_eviction_keeps_the_blocks_loaded_back_most() -> None:
    tier, _ = _tier(2)
    tier.evicted(1, block_id=1, uses=2)
    tier.evicted(2, block_id=2, uses=2)
    assert tier.read(1) is not None  # block 1 paid off once: block 2 goes first
    tier.evicted(3, block_id=3, uses=2)
    assert 1 in tier and 3 in tier and 2 not in tier
    assert tier.stats.evicted_blocks == 1


def test_a_corrupt_block_is_dropped() -> None:
    tier, _ = _tier(2)
    tier.evicted(7, block_id=7, uses=2)
    slot = tier._slots[7][0]
    tier._map[slot * tier.block_bytes] ^= 0xFF  # a flipped bit in the file
    assert tier.read(7) is None and 7 not in tier
    assert tier.stats.corrupt_blocks == 1


def _fill(engine: LLMEngine, count: int, seed: int) -> None:
    """Prompts that take the cache's blocks (evicting what it held)."""
    reqs = [(f"fill-{seed}-{i}", p, GREEDY) for i, p in enumerate(prompts(*[40] * count, seed=seed))]
    run_all(engine, reqs)


def test_a_prefix_evicted_from_the_cache_comes_back_from_the_tier(make_engine: Factory) -> None:
    prompt = prompts(70, seed=31)[0]  # 4 full blocks of 16 before the last token
    reference = tokens(run_all(make_engine(enable_prefix_caching=False), [("r", prompt, GREEDY)])["r"])
    cached = {}
    for tier_mb in (0, 4):
        engine = make_engine(num_kv_blocks=16, kv_tier_mb=tier_mb)
        for turn in range(2):  # two uses: computed, then reused
            outs = run_all(engine, [(f"a{turn}", prompt, GREEDY)])[f"a{turn}"]
            assert tokens(outs) == reference
        _fill(engine, 6, seed=32)  # the cache's 16 blocks turn over: the prefix is evicted
        out = run_all(engine, [("back", prompt, GREEDY)])["back"]
        assert tokens(out) == reference
        cached[tier_mb] = out[0].num_cached_tokens
    assert cached[0] < 32 and cached[4] == 64
    stats = engine.stats().kv_tier
    assert stats is not None and stats.hit_tokens == 64 - cached[0] >= 32
    assert stats.loaded_blocks == stats.hit_tokens // 16


def test_a_corrupt_tier_block_is_computed_again(make_engine: Factory) -> None:
    prompt = prompts(70, seed=33)[0]
    reference = tokens(run_all(make_engine(enable_prefix_caching=False), [("r", prompt, GREEDY)])["r"])
    engine = make_engine(num_kv_blocks=16, kv_tier_mb=4)
    tier = engine.block_manager.tier
    assert tier is not None
    for turn in range(2):
        run_all(engine, [(f"a{turn}", prompt, GREEDY)])
    _fill(engine, 6, seed=34)
    last = _request(engine, prompt).block_hashes[3]
    assert last in tier  # a request's tail is evicted first
    slot = tier._slots[last][0]
    tier._map[slot * tier.block_bytes + 5] ^= 0x01  # the fourth block's bytes changed
    out = run_all(engine, [("back", prompt, GREEDY)])["back"]
    assert tokens(out) == reference
    assert out[0].num_cached_tokens == 48  # the first three blocks; the fourth computed
    stats = engine.stats().kv_tier
    assert stats is not None and stats.corrupt_blocks == 1


def _request(engine: LLMEngine, prompt: list[int]) -> Request:
    """A request of ``prompt`` as the engine hashes it (not added)."""
    request = Request("probe", list(prompt), GREEDY)
    engine.block_manager.ensure_hashes(request, 4)
    return request


def test_the_scheduler_hears_where_each_block_is() -> None:
    """Evicted into the tier: "offloaded" (the worker still holds it; routing prices it at
    a load); dropped by the tier: "removed"; loaded back: "stored", its load timed."""
    stand_in = Blocks()
    tier = KvTier(1, stand_in.size, stand_in.read, stand_in.write, admit_after=1)
    bm = BlockManager(num_blocks=4, block_size=4, tier=tier)
    first = Request("first", list(range(1, 10)), GREEDY)  # two full blocks and a token
    assert bm.allocate(first, 9)
    first.num_computed_tokens = 9
    bm.free(first)
    h0, h1 = first.block_hashes[:2]
    bm.take_events()
    second = Request("second", list(range(50, 66)), GREEDY)
    assert bm.allocate(second, 16)  # all 4 blocks: both cached blocks are evicted
    events = [(e.kind, e.block_hashes) for e in bm.take_events()]
    # The tail went first, into the tier; the head displaced it there (one slot).
    assert events == [("offloaded", [h1]), ("removed", [h1]), ("offloaded", [h0])]
    assert h0 in tier and h1 not in tier
    bm.free(second)
    assert bm.tier_load_rate.per_s == 0.0
    again = Request("again", list(range(1, 10)), GREEDY)
    assert bm.allocate(again, 5)  # the first block from the tier, the rest computed
    assert [(e.kind, e.block_hashes) for e in bm.take_events()] == [("stored", [h0])]
    assert again.num_cached_tokens == 4 and bm.tier_load_rate.per_s > 0.0
