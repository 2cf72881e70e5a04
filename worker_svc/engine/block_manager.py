"""Paged KV block allocation with automatic prefix caching.

Design (after vLLM v1's KVCacheManager):

* Every block has a ``ref_count`` and, once it is full *and computed*, a
  ``block_hash`` (chained, :mod:`services.kv_hash`). ``hash -> block`` finds reusable
  prefixes.
* Free blocks sit in one queue ordered for eviction. Freed blocks that carry a hash
  go to the tail (least recently used first out; a request's blocks are appended in
  reverse so its tail is evicted before its more shareable head). Freed blocks
  without a hash hold nothing reusable and go to the head. Allocation pops the head;
  a popped block that still had a hash is evicted from the cache ("removed" event, or
  "offloaded" when the KV tier keeps it).
* A cache hit on a free block takes it out of the queue (ref 0 -> 1); a hit on a
  block in use just bumps its ref count.
* Blocks are registered (hashed, "stored" event) only after their KV was computed,
  so a failed step can never publish garbage KV.
* With a KV tier (:mod:`worker_svc.engine.kv_tier`), an evicted block goes there (when it
  was used often enough) and a prefix continues there where the cache's run ends: those
  blocks are loaded into free blocks when the request is allocated, checked, and count as
  cached (a corrupt one ends the prefix: the rest is computed).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from services.kv_hash import block_hashes
from worker_svc.engine.kv_tier import KvTier
from worker_svc.engine.request import Request
from worker_svc.engine.token_rate import TokenRate

__all__ = ["BlockManager", "KVBlock", "KvEvent", "KvEventKind"]

KvEventKind = Literal["stored", "offloaded", "removed", "cleared"]


@dataclass
class KvEvent:
    """A change of the worker's prefix cache, for the global (cache-aware) scheduler.

    ``stored``: ``block_hashes`` (a chained run) became reusable; ``parent_hash`` is the
    hash of the block before the first one (None at the start of a sequence) and
    ``token_ids`` the tokens of all the blocks (also when loaded back from the KV tier).
    ``offloaded``: the cache evicted the hashes into the KV tier (still reusable, at the
    cost of a load). ``removed``: the worker holds them no more (in neither place).
    ``cleared``: the whole cache (and tier) was dropped.
    """

    kind: KvEventKind
    block_hashes: list[int] = field(default_factory=list)
    parent_hash: int | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass(eq=False)
class KVBlock:
    """One physical KV block."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    uses: int = 0  # requests that computed or reused it under its hash (the tier's admission)


class BlockManager:
    """Owns the ``num_blocks`` KV blocks and the prefix cache over them."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_event: Callable[[list[KvEvent]], None] | None = None,
        tier: KvTier | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.on_event = on_event
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        # request_id -> number of leading blocks already registered (or skipped) in the cache.
        self._num_registered: dict[str, int] = {}
        self._events: list[KvEvent] = []
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.tier = tier if enable_prefix_caching else None
        # Prompt tokens per second loaded from the tier (the scheduler prices a tier hit with it).
        self.tier_load_rate = TokenRate()
        if self.tier is not None:
            self.tier.on_dropped = self._tier_dropped

    # ---------------------------------------------------------------- stats
    @property
    def num_total_blocks(self) -> int:
        """All blocks of the cache."""
        return len(self.blocks)

    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0 (cached-but-unused blocks count as free)."""
        return len(self._free)

    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return len(self.blocks) - len(self._free)

    def num_cached_blocks(self) -> int:
        """Blocks currently findable by hash."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use by requests (0..1)."""
        return self.num_used_blocks() / len(self.blocks)

    def prefix_hit_rate(self) -> float:
        """Cached tokens / looked-up prompt tokens since start."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    # ------------------------------------------------------------- hashing
    def ensure_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Extend ``request.block_hashes`` to its first ``num_blocks`` full blocks."""
        bs = self.block_size
        hashes = request.block_hashes
        done = len(hashes)
        if done < num_blocks:
            tokens = request.token_slice(done * bs, num_blocks * bs)
            hashes.extend(block_hashes(tokens, bs, request.extra_keys, hashes[-1] if hashes else None))
        return hashes

    def _find_cached_prefix(self, request: Request) -> tuple[list[KVBlock], list[int]]:
        """The cached blocks of the request's longest cached prefix, and the hashes of the
        tier's blocks that continue it."""
        # Requests wanting prompt logprobs need logits for every prompt position: no reuse
        # until they have them (vLLM's rule; the blocks they compute are still published).
        wants_logits = (
            request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent
        )
        if not self.enable_prefix_caching or wants_logits:
            return [], []
        # Never hit the last token: at least one token must run through the model so the
        # request gets logits. With an exact multiple of block_size this recomputes the
        # whole last block into a private block instead of writing into a shared one.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        hashes = self.ensure_hashes(request, max_blocks)[:max_blocks]
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        tiered: list[int] = []
        if self.tier is not None:
            for h in hashes[len(hits) :]:
                if h not in self.tier:
                    break
                tiered.append(h)
        return hits, tiered

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens ``allocate`` would reuse from the cache and its tier right now (no side effects)."""
        hits, tiered = self._find_cached_prefix(request)
        return (len(hits) + len(tiered)) * self.block_size

    # ----------------------------------------------------------- allocation
    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``allocate(request, num_new_tokens)`` would succeed."""
        return self.num_blocks_needed(request, num_new_tokens) <= len(self._free)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks ``allocate(request, num_new_tokens)`` would take."""
        return self._blocks_needed(*self._find_cached_prefix(request), num_new_tokens)

    def _blocks_needed(self, hits: list[KVBlock], tiered: list[int], num_new_tokens: int) -> int:
        total = (len(hits) + len(tiered)) * self.block_size + num_new_tokens
        new_blocks = -(-total // self.block_size) - len(hits)  # the tier's go into new blocks
        # Hits on free blocks take them out of the free queue too.
        return new_blocks + sum(1 for b in hits if b.ref_count == 0)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give a waiting request its blocks: the longest cached prefix plus room for
        ``num_new_tokens`` tokens after it. Sets ``num_cached_tokens`` and
        ``num_computed_tokens``. Returns False (nothing changed) if blocks are short."""
        if request.block_table:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        hits, tiered = self._find_cached_prefix(request)
        bs = self.block_size
        if num_new_tokens <= 0 or (len(hits) + len(tiered)) * bs + num_new_tokens > request.num_tokens:
            raise ValueError(f"invalid num_new_tokens={num_new_tokens} for request {request.request_id}")
        if self._blocks_needed(hits, tiered, num_new_tokens) > len(self._free):
            return False
        for block in hits:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1
            block.uses += 1
        loaded = self._load_tiered(request, len(hits), tiered)
        num_cached = (len(hits) + len(loaded)) * bs
        new_count = -(-(num_cached + num_new_tokens) // bs) - len(hits) - len(loaded)
        request.block_table = (
            [b.block_id for b in hits] + loaded + [self._pop_free() for _ in range(new_count)]
        )
        request.num_cached_tokens = num_cached
        request.num_computed_tokens = num_cached
        self._num_registered[request.request_id] = len(hits) + len(loaded)
        self.prefix_queried_tokens += request.num_tokens
        self.prefix_hit_tokens += num_cached
        if loaded and self.tier is not None:
            self.tier.stats.hit_tokens += len(loaded) * bs
        return True

    def _load_tiered(self, request: Request, first: int, tiered: list[int]) -> list[int]:
        """Loads the tier's blocks of the request's prefix (from block ``first``) into free
        blocks registered under their hashes; their ids, up to the first corrupt one."""
        if self.tier is None or not tiered:
            return []
        started = time.perf_counter()
        found: list[tuple[int, bytes]] = []
        for h in tiered:  # read first: freeing blocks below may evict tier slots
            data = self.tier.read(h)
            if data is None:
                break
            found.append((h, data))
        loaded = []
        for h, data in found:
            block = self.blocks[self._pop_free()]
            self.tier.load(block.block_id, data)
            block.block_hash, block.uses = h, 1
            self._cached[h] = block
            loaded.append(block.block_id)
        if loaded:
            self._emit_stored(request, list(range(first, first + len(loaded))))
            self.tier_load_rate.add(len(loaded) * self.block_size, time.perf_counter() - started)
        return loaded

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow a running request's table to hold ``num_new_tokens`` more tokens.

        Registers blocks that became full and computed since the last call. Returns
        False (nothing allocated) when there are not enough free blocks.
        """
        if request.num_computed_tokens // self.block_size > self._num_registered.get(request.request_id, 0):
            self.mark_computed(request)  # a block filled since the last registration
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        missing = needed - len(request.block_table)
        if missing <= 0:  # most decode steps: the last block has room
            return True
        if missing > len(self._free):
            return False
        request.block_table.extend(self._pop_free() for _ in range(missing))
        return True

    def _pop_free(self) -> int:
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                kept = self.tier is not None and self.tier.evicted(
                    block.block_hash, block.block_id, block.uses
                )
                self._emit_gone("offloaded" if kept else "removed", block.block_hash)
            block.block_hash = None
        block.ref_count, block.uses = 1, 0
        return block.block_id

    def mark_computed(self, request: Request) -> None:
        """Register (hash + "stored" event) the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # Tokens still in flight (async scheduling) are not known yet: their blocks wait.
        full = min(request.num_computed_tokens, request.num_known_tokens, len(request.block_table) * bs) // bs
        start = self._num_registered.get(request.request_id, 0)
        if full <= start:
            return
        hashes = self.ensure_hashes(request, full)
        run: list[int] = []
        for i in range(start, full):
            block = self.blocks[request.block_table[i]]
            h = hashes[i]
            # A block computed concurrently by another request may already own this hash;
            # keep that one and leave this copy private (it is freed normally).
            if block.block_hash is None and h not in self._cached:
                block.block_hash, block.uses = h, 1
                self._cached[h] = block
                run.append(i)
            elif run:
                self._emit_stored(request, run)
                run = []
        if run:
            self._emit_stored(request, run)
        self._num_registered[request.request_id] = full

    def free(self, request: Request) -> None:
        """Release the request's blocks; hashed ones stay reusable until evicted."""
        self.mark_computed(request)
        self.unpin(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        self._num_registered.pop(request.request_id, None)

    def import_block(
        self, block_hash: int, parent_hash: int | None, token_ids: list[int]
    ) -> tuple[int, bool] | None:
        """Pin a prefix-cache block for KV computed elsewhere (P/D hand-off): the block
        already cached under ``block_hash`` (returns ``(id, False)``: nothing to write), or
        a free block registered under it (``(id, True)``: the caller writes its KV before
        the next step). None when no block is free. Pinned blocks are in use until `unpin`."""
        cached = self.pin_cached(block_hash)
        if cached is not None:
            return cached, False
        if not self._free:
            return None
        block = self.blocks[self._pop_free()]
        block.block_hash, block.uses = block_hash, 1
        self._cached[block_hash] = block
        self._events.append(
            KvEvent("stored", block_hashes=[block_hash], parent_hash=parent_hash, token_ids=list(token_ids))
        )
        return block.block_id, True

    def pin_cached(self, block_hash: int) -> int | None:
        """One more reference to the block cached under ``block_hash``; None when none is."""
        block = self._cached.get(block_hash)
        if block is None:
            return None
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1
        return block.block_id

    def reserve(self, count: int) -> list[int] | None:
        """``count`` free blocks, pinned and empty (no hash), or None (nothing taken) when
        fewer are free: a hand-off's room, taken before its prefill runs elsewhere."""
        if count > len(self._free):
            return None
        return [self._pop_free() for _ in range(count)]

    def unpin(self, block_ids: list[int]) -> None:
        """Drop one reference of each block (pinned by `import_block` or a held transfer);
        unreferenced blocks become free, still findable by hash until evicted."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"double free of block {block_id}")
            if block.ref_count == 0:
                self._free[block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible while no request holds blocks."""
        if self.num_used_blocks():
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.tier is not None:
            self.tier.clear()
        self._events.append(KvEvent("cleared"))
        return True

    def _tier_dropped(self, block_hash: int) -> None:
        if block_hash not in self._cached:
            self._emit_gone("removed", block_hash)

    # --------------------------------------------------------------- events
    def _emit_stored(self, request: Request, indices: list[int]) -> None:
        first, last = indices[0], indices[-1]
        self._events.append(
            KvEvent(
                "stored",
                block_hashes=[request.block_hashes[i] for i in indices],
                parent_hash=request.block_hashes[first - 1] if first else None,
                token_ids=request.token_slice(first * self.block_size, (last + 1) * self.block_size),
            )
        )

    def _emit_gone(self, kind: KvEventKind, block_hash: int) -> None:
        """An "offloaded" or "removed" event; those of one allocation burst coalesce."""
        if self._events and self._events[-1].kind == kind:
            self._events[-1].block_hashes.append(block_hash)
        else:
            self._events.append(KvEvent(kind, block_hashes=[block_hash]))

    def take_events(self) -> list[KvEvent]:
        """Return and clear the buffered events."""
        events, self._events = self._events, []
        return events

    def flush_events(self) -> None:
        """Deliver buffered events to ``on_event`` (once per engine step)."""
        events = self.take_events()
        if events and self.on_event is not None:
            self.on_event(events)
