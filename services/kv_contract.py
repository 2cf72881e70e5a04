"""What a worker and the scheduler must agree on about KV-cache blocks, besides the
hash scheme itself (`services.kv_hash`): the extra keys mixed into a request's block
hashes, and the Redis keys KV events travel under.

Workers hash the blocks they cache with `request_extra_keys`; the scheduler hashes
incoming prompts with the same function, so a prefix cached on a worker is found by
the scheduler's index bit for bit. One function, called by both (and by the engine for
requests that carry images or run under a LoRA adapter), so the two sides cannot drift.
The KV events carry these hashes, so a block cached under one adapter is published, and
found by the scheduler, only under that adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "INDEX_KEY_PREFIX",
    "SEQ_KEY_PREFIX",
    "SET_CHANGES",
    "STREAM_KEY",
    "SUBSCRIBER_POLL_INTERVAL_MS",
    "TIER_KEY_PREFIX",
    "MultiModalKey",
    "index_key",
    "request_extra_keys",
    "seq_key",
    "tier_key",
    "with_lora_key",
    "with_mm_keys",
]

# Tokens per KV block unless configured: the workers' --block-size and the scheduler's,
# which must be equal for prefix-aware routing.
DEFAULT_BLOCK_SIZE = 16

# Redis stream of KV events (stored / offloaded / removed block hashes) from every worker.
STREAM_KEY = "meshserve:kv-events"
# Per worker: the set of block hashes it holds (snapshot rewritten on resync), ...
INDEX_KEY_PREFIX = "meshserve:kv-index:"
# ... those of them in its KV tier rather than its cache (a subset), ...
TIER_KEY_PREFIX = "meshserve:kv-tier:"
# ... and the stream id of the last event folded into that set.
SEQ_KEY_PREFIX = "meshserve:kv-seq:"
# What an event of each kind does to a worker's two block sets, (held, in its tier): True
# adds the event's hashes to the set, False takes them out. The publisher's mirror, its
# Redis sets and the scheduler's prefix index all fold events by this table; "cleared"
# empties both sets, "resync" marks a rewritten snapshot.
SET_CHANGES: dict[str, tuple[bool, bool]] = {
    "stored": (True, False),  # computed, or loaded back from the tier: in the cache
    "offloaded": (True, True),  # the cache evicted it into the tier: still held
    "removed": (False, False),  # held no more, in neither place
}
# The scheduler reads the stream at most this often, and a worker gathers its events
# this long by default before it writes them (`kv_events_flush_ms`): written more often,
# they would cost the worker's writer thread and Redis a transaction each
# (docs/design-decisions.md, "KV events gathered 100 ms") and reach the
# scheduler no sooner than its next read. Its own routing decisions count as cached
# meanwhile (`PrefixIndex` speculative entries, 2 s).
SUBSCRIBER_POLL_INTERVAL_MS = 100


class MultiModalKey(Protocol):
    """Anything with a content identifier and a prompt offset (proto item or engine input)."""

    @property
    def identifier(self) -> str: ...

    @property
    def offset(self) -> int: ...


def with_mm_keys(extra_keys: Sequence[str], items: Iterable[MultiModalKey]) -> tuple[str, ...]:
    """``extra_keys`` plus ``mm:<identifier>`` per item in prompt order (by offset), each
    identifier once: prompts with different images never share KV blocks, and the same
    image twice keys the blocks like once."""
    keys = list(extra_keys)
    for item in sorted(items, key=lambda m: m.offset):
        key = "mm:" + item.identifier
        if key not in keys:
            keys.append(key)
    return tuple(keys)


def with_lora_key(extra_keys: Sequence[str], lora_name: str) -> tuple[str, ...]:
    """``extra_keys`` plus ``lora:<lora_name>`` when the request runs under a LoRA adapter
    (once): the same prompt under two adapters (or none) never shares KV blocks."""
    key = "lora:" + lora_name
    if not lora_name or key in extra_keys:
        return tuple(extra_keys)
    return (*extra_keys, key)


def request_extra_keys(
    cache_salt: str = "", mm_items: Iterable[MultiModalKey] = (), lora_name: str = ""
) -> tuple[str, ...]:
    """The ``extra_keys`` of a request's block hashes: ``salt:<cache_salt>`` when a salt
    is set (tenant isolation), the adapter's key of `with_lora_key`, then the multimodal
    keys of `with_mm_keys`."""
    return with_mm_keys(with_lora_key([f"salt:{cache_salt}"] if cache_salt else [], lora_name), mm_items)


def index_key(worker_id: str) -> str:
    """Redis set of the block hashes `worker_id` holds."""
    return INDEX_KEY_PREFIX + worker_id


def tier_key(worker_id: str) -> str:
    """Redis set of the block hashes `worker_id` holds in its KV tier (a subset of its index set)."""
    return TIER_KEY_PREFIX + worker_id


def seq_key(worker_id: str) -> str:
    """Redis key of the last KV event of `worker_id` folded into its index set."""
    return SEQ_KEY_PREFIX + worker_id
