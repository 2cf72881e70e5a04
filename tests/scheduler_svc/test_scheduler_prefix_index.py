"""PrefixIndex: events, cursors (duplicates, gaps, epochs), rebuild, speculation, match."""

from __future__ import annotations

from scheduler_svc.prefix_index import ApplyResult, KvRecord, PrefixIndex
from tests.fake_clock import FakeClock


def rec(
    seq: int, kind: str = "stored", hashes: tuple[int, ...] = (), worker: str = "w1", epoch: str = "e1"
) -> KvRecord:
    return KvRecord(worker, epoch, seq, kind, hashes)


def test_events_apply_and_remove() -> None:
    index = PrefixIndex()
    assert index.apply(rec(1, hashes=(1,))) is ApplyResult.RESYNC  # unknown worker: resync first
    index.reset_worker("w1", [], "e1", 0)
    assert index.apply(rec(1, hashes=(1, 2, 3))) is ApplyResult.APPLIED
    assert index.match([1, 2, 3, 4], ["w1"]) == {"w1": 3}
    assert index.apply(rec(2, "removed", (3,))) is ApplyResult.APPLIED
    assert index.match([1, 2, 3], ["w1"]) == {"w1": 2}
    assert index.apply(rec(3, "cleared")) is ApplyResult.APPLIED
    assert index.match([1, 2, 3], ["w1"]) == {"w1": 0}
    assert index.num_blocks("w1") == 0


def test_duplicates_gaps_and_new_epochs() -> None:
    index = PrefixIndex()
    index.reset_worker("w1", [1, 2], "e1", 5)
    assert index.apply(rec(4, hashes=(9,))) is ApplyResult.DUPLICATE
    assert index.apply(rec(5, hashes=(9,))) is ApplyResult.DUPLICATE
    assert not index.holds("w1", 9)
    assert index.apply(rec(6, hashes=(3,))) is ApplyResult.APPLIED
    assert index.apply(rec(8, hashes=(4,))) is ApplyResult.RESYNC  # seq 7 went missing
    assert not index.holds("w1", 4)
    assert index.apply(rec(1, hashes=(4,), epoch="e2")) is ApplyResult.RESYNC  # worker restarted
    assert index.apply(rec(7, "resync", epoch="e1")) is ApplyResult.RESYNC
    assert index.cursor("w1") == ("e1", 6)


def test_rebuild_replaces_worker_and_keeps_others() -> None:
    index = PrefixIndex()
    index.reset_worker("w1", [1, 2, 3], "e1", 3)
    index.reset_worker("w2", [1, 2], "e2", 7)
    assert index.match([1, 2, 3], ["w1", "w2"]) == {"w1": 3, "w2": 2}
    index.reset_worker("w1", [1], "e1", 9)
    assert index.match([1, 2, 3], ["w1", "w2"]) == {"w1": 1, "w2": 2}
    index.remove_worker("w2")
    assert index.match([1, 2, 3], ["w1", "w2"]) == {"w1": 1, "w2": 0}
    assert index.cursor("w2") is None
    assert index.workers() == ["w1"]


def test_match_is_longest_leading_prefix_among_requested_workers() -> None:
    index = PrefixIndex()
    index.reset_worker("a", [1, 2, 3, 4], "e", 1)
    index.reset_worker("b", [1, 2, 5], "e", 1)
    index.reset_worker("c", [2, 3, 4], "e", 1)  # holds later blocks but not the first one
    assert index.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert index.match([1, 2, 3, 4], ["b", "c"]) == {"b": 2, "c": 0}
    assert index.match([], ["a"]) == {"a": 0}


def test_speculative_entries_expire() -> None:
    clock = FakeClock(0.0)
    index = PrefixIndex(speculative_ttl_s=2.0, max_speculative_per_worker=3, clock=clock)
    index.add_speculative("w1", [7, 8])
    assert index.match([7, 8, 9], ["w1", "w2"]) == {"w1": 2, "w2": 0}
    clock.now = 1.0
    index.add_speculative("w2", [7, 8, 9, 10])  # capped at 3 entries: block 7 dropped
    assert index.match([7, 8, 9], ["w2"]) == {"w2": 0}
    clock.now = 2.5
    index.expire()
    assert index.match([7, 8], ["w1"]) == {"w1": 0}
    # A "removed" event also drops the speculation of that block.
    index.reset_worker("w3", [], "e", 0)
    index.add_speculative("w3", [1, 2])
    index.apply(KvRecord("w3", "e", 1, "removed", (1,)))
    assert index.match([1, 2], ["w3"]) == {"w3": 0}


def test_offloaded_blocks_stay_held_in_the_tier_until_loaded_back_or_removed() -> None:
    index = PrefixIndex()
    index.reset_worker("w1", [1, 2, 3, 4], "e1", 0, tiered=[4, 99])  # 99: not held, ignored
    assert index.tier_blocks("w1", [1, 2, 3, 4, 99]) == 1
    assert index.apply(rec(1, "offloaded", (2, 3))) is ApplyResult.APPLIED
    assert index.match([1, 2, 3, 4], ["w1"]) == {"w1": 4}
    assert index.tier_blocks("w1", [1, 2, 3, 4]) == 3
    assert index.apply(rec(2, "stored", (2,))) is ApplyResult.APPLIED  # loaded back
    assert index.apply(rec(3, "removed", (4,))) is ApplyResult.APPLIED  # the tier dropped it
    assert index.match([1, 2, 3, 4], ["w1"]) == {"w1": 3}
    assert index.tier_blocks("w1", [1, 2, 3, 4]) == 1
    assert index.apply(rec(4, "offloaded", (5,))) is ApplyResult.APPLIED  # held from the tier alone
    assert index.holds("w1", 5) and index.tier_blocks("w1", [5]) == 1
    assert index.apply(rec(5, "cleared")) is ApplyResult.APPLIED
    assert index.num_blocks("w1") == 0 and index.tier_blocks("w1", [3, 5]) == 0
