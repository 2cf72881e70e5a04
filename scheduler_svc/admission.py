"""Admission queue: bounded, priority first, round-robin across tenants within a priority.

Pure domain code, generic over the queued item. The dispatcher pushes a request it cannot
place yet and calls `drain` whenever capacity may have appeared; `drain` offers items in
order (highest priority first; within a priority, one item per tenant per round, the
tenant served last moving to the back) to a callback that either takes the item
(dispatched, or failed for good) or leaves it waiting. Items of a group that could not be
placed (same model, same exclusions) are skipped for the rest of the pass, so one model
without capacity never blocks another model's requests.

A full queue raises `Overloaded` (RESOURCE_EXHAUSTED → HTTP 429): never an unbounded
pile-up. A full queue still takes an item of higher priority than its lowest waiting one:
that one (the newest of the lowest priority) is pushed out, so sheddable requests are
refused first under overload.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.errors import Overloaded

T = TypeVar("T")


@dataclass(eq=False)
class _Entry(Generic[T]):
    item: T
    priority: int
    tenant: str
    seq: int = 0  # push order


class AdmissionQueue(Generic[T]):
    """Waiting requests by priority (higher first), then tenant (round-robin), then FIFO."""

    def __init__(self, max_len: int) -> None:
        if max_len < 0:
            raise ValueError("max_len must be >= 0")
        self.max_len = max_len
        self._levels: dict[int, OrderedDict[str, deque[_Entry[T]]]] = {}
        self._entries: dict[int, _Entry[T]] = {}  # id(item) -> entry
        self._len = 0
        self._pushed = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, item: object) -> bool:
        return id(item) in self._entries

    def push(self, item: T, priority: int = 0, tenant: str = "", *, front: bool = False) -> T | None:
        """Queues `item`; `front=True` (a retry of an admitted request) bypasses the limit.
        Returns the item pushed out of a full queue for it (None: none was)."""
        evicted = None
        if not front and self._len >= self.max_len:
            evicted = self._lowest_below(priority)
            if evicted is None:
                raise Overloaded(
                    f"scheduler queue is full ({self._len} requests waiting, limit {self.max_len}); retry later"
                )
            self.remove(evicted)
        self._pushed += 1
        entry = _Entry(item, priority, tenant, self._pushed)
        level = self._levels.setdefault(priority, OrderedDict())
        fifo = level.setdefault(tenant, deque())
        if front:
            fifo.appendleft(entry)
        else:
            fifo.append(entry)
        self._entries[id(item)] = entry
        self._len += 1
        return evicted

    def _lowest_below(self, priority: int) -> T | None:
        """The newest item of the lowest priority waiting, if that priority is below `priority`."""
        lowest = min(self._levels, default=None)
        if lowest is None or lowest >= priority:
            return None
        newest = max((fifo[-1] for fifo in self._levels[lowest].values()), key=lambda e: e.seq)
        return newest.item

    def remove(self, item: T) -> bool:
        """Removes a waiting item (cancelled, timed out); False when it is not queued."""
        entry = self._entries.pop(id(item), None)
        if entry is None:
            return False
        level = self._levels[entry.priority]
        fifo = level[entry.tenant]
        fifo.remove(entry)
        self._len -= 1
        if not fifo:
            del level[entry.tenant]
            if not level:
                del self._levels[entry.priority]
        return True

    def items(self) -> Iterator[T]:
        """Waiting items in no particular order."""
        return (entry.item for entry in list(self._entries.values()))

    def drain(self, take: Callable[[T], bool], group_of: Callable[[T], Hashable]) -> int:
        """Offers waiting items in fair order until none can be taken; returns how many were."""
        taken = 0
        blocked: set[Hashable] = set()
        for priority in sorted(self._levels, reverse=True):
            taken += self._drain_level(priority, take, group_of, blocked)
        return taken

    def _drain_level(
        self,
        priority: int,
        take: Callable[[T], bool],
        group_of: Callable[[T], Hashable],
        blocked: set[Hashable],
    ) -> int:
        taken = 0
        progress = True
        while progress and priority in self._levels:
            progress = False
            level = self._levels[priority]
            for tenant in list(level):
                if self._serve_tenant(level, tenant, take, group_of, blocked):
                    taken += 1
                    progress = True
                if priority not in self._levels:
                    break
        return taken

    def _serve_tenant(
        self,
        level: OrderedDict[str, deque[_Entry[T]]],
        tenant: str,
        take: Callable[[T], bool],
        group_of: Callable[[T], Hashable],
        blocked: set[Hashable],
    ) -> bool:
        """Offers the tenant's first items of unblocked groups until one is taken."""
        while True:
            entry = self._next_unblocked(level.get(tenant, ()), group_of, blocked)
            if entry is None:
                return False
            if take(entry.item):
                self.remove(entry.item)
                if tenant in level:
                    level.move_to_end(tenant)
                return True
            blocked.add(group_of(entry.item))

    @staticmethod
    def _next_unblocked(
        fifo: deque[_Entry[T]] | tuple[()],
        group_of: Callable[[T], Hashable],
        blocked: set[Hashable],
    ) -> _Entry[T] | None:
        for entry in fifo:
            if group_of(entry.item) not in blocked:
                return entry
        return None
