"""Which worker holds which KV blocks: the prefix index behind prefix-aware routing.

Pure domain code. Workers publish KV events (blocks stored / offloaded into the KV tier /
removed / cache cleared)
with a per-worker `(epoch, seq)` cursor; `apply` folds them in and tells the caller when
it must resync a worker from its full block set instead (first contact, new epoch after a
restart, or a gap in `seq`). Routing decisions are also recorded as short-lived
*speculative* entries so a burst of requests sharing a new prefix follows the first one
before the worker's events arrive.

Block hashes are chained (see `services.kv_hash`), so a worker that holds block i of a
prompt's hash list holds a prefix ending there; `match` returns, per worker, the number of
leading blocks it holds, and `tier_blocks` how many of those are in its KV tier (held,
but to be loaded before use).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from services.clock import Clock
from services.kv_contract import SET_CHANGES

KIND_CLEARED = "cleared"
# A snapshot marker: the worker rewrote its whole block set (start-up, after an outage).
KIND_RESYNC = "resync"


class ApplyResult(StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already covered by the worker's snapshot
    RESYNC = "resync"  # reload the worker from its block set


@dataclass(frozen=True)
class KvRecord:
    """One KV event of one worker, as carried by the event stream."""

    worker_id: str
    epoch: str
    seq: int
    kind: str
    hashes: tuple[int, ...] = ()


class PrefixIndex:
    """Block hash → workers holding it, per-worker block sets and event cursors."""

    def __init__(
        self,
        speculative_ttl_s: float = 2.0,
        max_speculative_per_worker: int = 65536,
        clock: Clock = time.monotonic,
    ) -> None:
        self._ttl = speculative_ttl_s
        self._max_speculative = max_speculative_per_worker
        self._clock = clock
        self._owners: dict[int, set[str]] = {}
        self._held: dict[str, set[int]] = {}
        self._tiered: dict[str, set[int]] = {}  # of each worker's held blocks, those in its tier
        self._cursor: dict[str, tuple[str, int]] = {}
        # worker -> hash -> expiry, oldest first (the TTL is constant).
        self._speculative: dict[str, OrderedDict[int, float]] = {}
        self._speculative_owners: dict[int, dict[str, float]] = {}

    # -- event stream -------------------------------------------------------------------

    def apply(self, record: KvRecord) -> ApplyResult:
        """Folds one event in, or says why the worker needs a resync."""
        cursor = self._cursor.get(record.worker_id)
        if record.kind == KIND_RESYNC or cursor is None or cursor[0] != record.epoch:
            return ApplyResult.RESYNC
        if record.seq <= cursor[1]:
            return ApplyResult.DUPLICATE
        if record.seq != cursor[1] + 1:
            return ApplyResult.RESYNC
        if record.kind == KIND_CLEARED:
            self._drop_confirmed(record.worker_id)
        elif record.kind in SET_CHANGES:  # stored / offloaded / removed
            held, in_tier = SET_CHANGES[record.kind]
            (self._add if held else self._remove)(record.worker_id, record.hashes)
            tiered = self._tiered.setdefault(record.worker_id, set())
            (tiered.update if in_tier else tiered.difference_update)(record.hashes)
        self._cursor[record.worker_id] = (record.epoch, record.seq)
        return ApplyResult.APPLIED

    def reset_worker(
        self, worker_id: str, hashes: Iterable[int], epoch: str, seq: int, tiered: Iterable[int] = ()
    ) -> None:
        """Replaces a worker's block set (and of it, those in its tier) with a snapshot
        taken at cursor (epoch, seq)."""
        self._drop_confirmed(worker_id)
        self._add(worker_id, hashes)
        self._tiered[worker_id] = set(tiered) & self._held.get(worker_id, set())
        self._cursor[worker_id] = (epoch, seq)

    def remove_worker(self, worker_id: str) -> None:
        """Forgets everything about a worker (it is down); its next event forces a resync."""
        self._drop_confirmed(worker_id)
        self._cursor.pop(worker_id, None)
        for block in list(self._speculative.pop(worker_id, OrderedDict())):
            self._drop_speculative_owner(block, worker_id)

    def clear(self) -> None:
        self._owners.clear()
        self._held.clear()
        self._tiered.clear()
        self._cursor.clear()
        self._speculative.clear()
        self._speculative_owners.clear()

    def cursor(self, worker_id: str) -> tuple[str, int] | None:
        return self._cursor.get(worker_id)

    def workers(self) -> list[str]:
        return sorted(set(self._held) | set(self._cursor))

    def num_blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def blocks(self, worker_id: str) -> frozenset[int]:
        """The blocks KV events say the worker holds (speculative entries excluded)."""
        return frozenset(self._held.get(worker_id, ()))

    def tier_blocks(self, worker_id: str, hashes: Iterable[int]) -> int:
        """How many of `hashes` the worker holds in its KV tier rather than its cache."""
        tiered = self._tiered.get(worker_id)
        return sum(1 for block in hashes if block in tiered) if tiered else 0

    def holds(self, worker_id: str, block: int) -> bool:
        return block in self._held.get(worker_id, ())

    # -- routing ----------------------------------------------------------------------

    def add_speculative(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Records that `worker_id` is about to compute `hashes` (expires after the TTL)."""
        if self._ttl <= 0 or not hashes:
            return
        self.expire()
        expiry = self._clock() + self._ttl
        entries = self._speculative.setdefault(worker_id, OrderedDict())
        for block in hashes:
            entries[block] = expiry
            entries.move_to_end(block)
            self._speculative_owners.setdefault(block, {})[worker_id] = expiry
        while len(entries) > self._max_speculative:
            block, _ = entries.popitem(last=False)
            self._drop_speculative_owner(block, worker_id)

    def expire(self) -> None:
        """Drops speculative entries past their TTL."""
        now = self._clock()
        for worker_id, entries in list(self._speculative.items()):
            while entries:
                block, expiry = next(iter(entries.items()))
                if expiry > now:
                    break
                entries.popitem(last=False)
                self._drop_speculative_owner(block, worker_id)
            if not entries:
                del self._speculative[worker_id]

    def match(self, hashes: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Per worker in `workers`, how many leading blocks of `hashes` it holds."""
        result = dict.fromkeys(workers, 0)
        remaining = set(result)
        now = self._clock()
        for depth, block in enumerate(hashes, start=1):
            holders = self._owners.get(block, set()) & remaining
            speculative = self._speculative_owners.get(block)
            if speculative:
                holders |= {w for w, expiry in speculative.items() if expiry > now and w in remaining}
            if not holders:
                break
            for worker_id in holders:
                result[worker_id] = depth
            remaining = holders
        return result

    # -- internals --------------------------------------------------------------------

    def _add(self, worker_id: str, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(worker_id, set())
        for block in hashes:
            held.add(block)
            self._owners.setdefault(block, set()).add(worker_id)

    def _remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        held = self._held.get(worker_id)
        speculative = self._speculative.get(worker_id)
        for block in hashes:
            if held is not None and block in held:
                held.discard(block)
                self._drop_owner(block, worker_id)
            if speculative is not None and speculative.pop(block, None) is not None:
                self._drop_speculative_owner(block, worker_id)

    def _drop_confirmed(self, worker_id: str) -> None:
        self._tiered.pop(worker_id, None)
        for block in self._held.pop(worker_id, set()):
            self._drop_owner(block, worker_id)

    def _drop_owner(self, block: int, worker_id: str) -> None:
        owners = self._owners.get(block)
        if owners is not None:
            owners.discard(worker_id)
            if not owners:
                del self._owners[block]

    def _drop_speculative_owner(self, block: int, worker_id: str) -> None:
        owners = self._speculative_owners.get(block)
        if owners is not None:
            owners.pop(worker_id, None)
            if not owners:
                del self._speculative_owners[block]
