"""The KV tier: a bounded store below the KV cache for blocks the cache evicts, so that a
prefix that comes back is loaded instead of computed again.

Keyed by the same block hash as the cache (:mod:`services.kv_hash`). The bytes live in a
memory-mapped file (default: an unlinked temp file, so the tier may be larger than RAM; on
a GPU worker the cache is copied to host memory through it), one slot per block, each with
a CRC-32 checked when it is loaded: a slot whose bytes changed is dropped and its tokens
computed again.

Admission after repeated use: a block is stored when it is evicted only if requests have
used it (computed it or found it cached) ``admit_after`` times, counting uses before an
earlier eviction (a bounded memory of evicted hashes): a prompt seen once never displaces
one a conversation keeps coming back to. Eviction is frequency-aware: the victim is the
least recently used block among those loaded back the fewest times (counts capped at
``MAX_FREQ``), so one scan of new prompts cannot flush the blocks that keep paying.

Pure engine code: it reads and writes KV through the two functions it is given (the
model runner's `read_block` / `write_block`), on the engine thread, between steps.

The scheduler's prefix index knows where each block is: the cache's eviction into the tier
sends an "offloaded" event, a load back a "stored" one, and "removed" comes when the tier
drops it. A conversation that comes back is routed to the decoder whose tier has its
prefix, its tier blocks priced at what loading them costs there (the worker's measured
tier load rate against its prefill rate).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["KvTier", "TierStats"]

MAX_FREQ = 3
_GHOSTS_PER_SLOT = 4  # evicted hashes remembered (with their uses) per tier slot


@dataclass
class TierStats:
    """What the tier did since start (engine stats and worker metrics)."""

    blocks: int = 0  # held now (set in snapshots)
    hit_tokens: int = 0  # prompt tokens loaded instead of computed
    stored_blocks: int = 0
    loaded_blocks: int = 0
    evicted_blocks: int = 0
    corrupt_blocks: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class KvTier:
    """``capacity`` slots of ``block_bytes`` (module docstring)."""

    def __init__(
        self,
        capacity: int,
        block_bytes: int,
        read_block: Callable[[int], bytes],
        write_block: Callable[[int, bytes], None],
        admit_after: int = 2,
        path: str = "",
    ) -> None:
        if capacity <= 0 or block_bytes <= 0 or admit_after < 1:
            raise ValueError("capacity, block_bytes and admit_after must be positive")
        self.capacity, self.block_bytes, self.admit_after = capacity, block_bytes, admit_after
        self.read_block, self.write_block = read_block, write_block
        self.stats = TierStats()
        # Called with each hash the tier no longer holds (the block manager tells the
        # scheduler's index, unless the cache holds the block again).
        self.on_dropped: Callable[[int], None] = lambda block_hash: None
        self._file = open(path, "w+b") if path else tempfile.TemporaryFile(prefix="meshserve-kv-tier-")
        os.ftruncate(self._file.fileno(), capacity * block_bytes)
        self._map = mmap.mmap(self._file.fileno(), capacity * block_bytes)
        self._slots: dict[int, tuple[int, int]] = {}  # hash -> (slot, crc)
        self._free: list[int] = []
        self._by_freq: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(MAX_FREQ + 1)]
        self._freq: dict[int, int] = {}
        self._ghosts: OrderedDict[int, int] = OrderedDict()  # evicted unadmitted hash -> uses
        self.clear()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def evicted(self, block_hash: int, block_id: int, uses: int) -> bool:
        """The cache evicts ``block_id`` (``block_hash``), used ``uses`` times: stored
        when its uses, with those before an earlier eviction, reach ``admit_after``.
        Whether the tier holds the block now."""
        if block_hash in self._slots:
            return True
        uses += self._ghosts.pop(block_hash, 0)
        if uses < self.admit_after:
            self._ghosts[block_hash] = uses
            if len(self._ghosts) > _GHOSTS_PER_SLOT * self.capacity:
                self._ghosts.popitem(last=False)
            return False
        slot = self._free.pop() if self._free else self._evict()
        data = self.read_block(block_id)
        self._map[slot * self.block_bytes : (slot + 1) * self.block_bytes] = data
        self._slots[block_hash] = (slot, zlib.crc32(data))
        self._touch(block_hash, 0)
        self.stats.stored_blocks += 1
        self.stats.bytes_written += len(data)
        return True

    def read(self, block_hash: int) -> bytes | None:
        """The block's bytes, checked (None: not here, or corrupt -- then dropped)."""
        found = self._slots.get(block_hash)
        if found is None:
            return None
        slot, crc = found
        data = bytes(self._map[slot * self.block_bytes : (slot + 1) * self.block_bytes])
        if zlib.crc32(data) != crc:
            self.stats.corrupt_blocks += 1
            self._drop(block_hash)
            return None
        self._touch(block_hash, min(MAX_FREQ, self._freq[block_hash] + 1))
        self.stats.bytes_read += len(data)
        return data

    def load(self, block_id: int, data: bytes) -> None:
        """Writes bytes ``read`` returned into cache block ``block_id``."""
        self.write_block(block_id, data)
        self.stats.loaded_blocks += 1

    def _touch(self, block_hash: int, freq: int) -> None:
        old = self._freq.get(block_hash)
        if old is not None:
            del self._by_freq[old][block_hash]
        self._freq[block_hash] = freq
        self._by_freq[freq][block_hash] = None

    def _evict(self) -> int:
        """Frees the slot of the least recently used block of the lowest frequency."""
        victim = next(next(iter(level)) for level in self._by_freq if level)
        slot = self._slots[victim][0]
        self._drop(victim)
        self._free.pop()  # the slot _drop just freed
        self.stats.evicted_blocks += 1
        return slot

    def _drop(self, block_hash: int) -> None:
        slot, _crc = self._slots.pop(block_hash)
        del self._by_freq[self._freq.pop(block_hash)][block_hash]
        self._free.append(slot)
        self.on_dropped(block_hash)

    def clear(self) -> None:
        """Forgets every block (the cache was reset: what it held may no longer apply; the
        reset's own "cleared" event tells the scheduler, so no block is reported dropped)."""
        self._slots.clear()
        self._freq.clear()
        for level in self._by_freq:
            level.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._ghosts.clear()
