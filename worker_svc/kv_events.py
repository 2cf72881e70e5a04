"""Publishes a worker's KV-cache events to Redis for the scheduler's prefix index.

The engine calls `KvEventPublisher.publish(events)` from its engine thread once per step.
`publish` only updates an in-memory mirror of the worker's block set and queues the
events; a background thread writes them, so an engine step never waits on Redis.

The writer gathers events for `flush_interval_s` (the worker's `kv_events_flush_ms`)
after the first one of a batch and writes them in one
transaction, adjacent events of one kind as one stream entry. Why: one transaction per
engine step cost the worker a Redis round trip of Python
work (interpreter lock included) right after the step that produced a request's first
token, i.e. while that token was on its way to the gateway, and cost the scheduler one
stream entry to parse per step. The scheduler reads the stream at most every
`services.kv_contract.SUBSCRIBER_POLL_INTERVAL_MS` and counts its own recent decisions
as cached meanwhile, so gathering as long does not change routing (docs/design-decisions.md,
"KV events gathered 100 ms").

Redis layout (shared with `scheduler_svc.kv_subscriber`):

* stream ``meshserve:kv-events`` (approximate MAXLEN), one entry per event with fields
  ``worker_id``, ``epoch`` (random per publisher instance), ``seq`` (per worker, +1 per
  entry), ``kind`` (stored | offloaded | removed | cleared | resync) and ``hashes``
  (comma-separated decimal uint64 block hashes);
* set ``meshserve:kv-index:{worker_id}``: the worker's current block hashes;
* set ``meshserve:kv-tier:{worker_id}``: those of them in its KV tier, not its cache
  (``offloaded`` adds to it; ``stored``, ``removed`` and ``cleared`` take out);
* string ``meshserve:kv-seq:{worker_id}``: ``"{epoch}:{seq}"`` of the last entry folded
  into the set.

Each write is one MULTI/EXEC transaction, so set, cursor and stream always agree. The
first write of a publisher, and the first one after Redis was unreachable or events were
dropped, is a *resync*: the set is rewritten from the mirror (on a fresh start: deleted)
and a ``resync`` entry tells subscribers to reload that worker. A transaction that finds
someone else's cursor (Redis restarted or was flushed) is followed by a resync too.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis
from prometheus_client import Counter
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.kv_contract import SET_CHANGES, STREAM_KEY, index_key, seq_key, tier_key
from worker_svc.config import WorkerConfig

log = logging.getLogger(__name__)

DEFAULT_STREAM_MAXLEN = 100_000
_SADD_CHUNK = 10_000

EVENTS_PUBLISHED = Counter(
    "meshserve_worker_kv_events_published_total", "KV events written to the Redis stream"
)
EVENTS_DROPPED = Counter(
    "meshserve_worker_kv_events_dropped_total",
    "KV events not written (Redis unreachable or backlog full); recovered by a resync",
)
RESYNCS = Counter("meshserve_worker_kv_resyncs_total", "Full block-set rewrites to Redis")


class KvEventLike(Protocol):
    """What the publisher reads from an engine `KvEvent`."""

    @property
    def kind(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class _Event:
    kind: str
    hashes: tuple[int, ...]


# A worker's blocks as a resync writes them: every block it holds, and those of them in its tier.
_Snapshot = tuple[set[int], set[int]]


def coalesce(events: Sequence[_Event]) -> list[_Event]:
    """`events` with each run of adjacent events of one kind (but "cleared") merged into
    one, in order: the same block sets and stream meaning in fewer entries."""
    merged: list[_Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if last is not None and last.kind == event.kind and event.kind in SET_CHANGES:
            merged[-1] = _Event(event.kind, last.hashes + event.hashes)
        else:
            merged.append(event)
    return merged


class KvEventPublisher:
    """Thread-safe, non-blocking publisher of one worker's KV events to Redis."""

    def __init__(
        self,
        redis_url: str,
        worker_id: str,
        *,
        stream_maxlen: int = DEFAULT_STREAM_MAXLEN,
        max_pending: int = 10_000,
        retry_interval_s: float = 1.0,
        flush_interval_s: float = WorkerConfig.kv_events_flush_ms / 1000,
        autostart: bool = True,
    ) -> None:
        if not worker_id:
            raise ValueError("worker_id is required")
        if flush_interval_s < 0:
            raise ValueError("flush_interval_s must be >= 0")
        self.worker_id = worker_id
        self.epoch = secrets.token_hex(8)
        self._url = redis_url
        self._maxlen = stream_maxlen
        self._max_pending = max_pending
        self._retry_interval_s = retry_interval_s
        self._flush_interval_s = flush_interval_s
        self._cond = threading.Condition()
        self._pending: list[_Event] = []
        self._mirror: set[int] = set()
        self._tier_mirror: set[int] = set()  # of _mirror, the blocks in the KV tier
        self._needs_resync = True
        self._seq = 0
        self._busy = False
        self._redis_down = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._client: redis.Redis | None = None
        self.published = 0
        self.dropped = 0
        self.resyncs = 0
        if autostart:
            self.start()

    @property
    def enabled(self) -> bool:
        return bool(self._url)

    def start(self) -> None:
        """Starts the writer thread (done by the constructor unless `autostart=False`); its
        first write replaces whatever a previous run of this worker left in Redis."""
        if not self.enabled or self._thread is not None or self._stopping:
            return
        self._client = redis.Redis.from_url(
            self._url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 1)
        )
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.worker_id}", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KvEventLike]) -> None:
        """Queues one engine step's events; never blocks on Redis (safe from any thread)."""
        if not self.enabled or not events:
            return
        batch = [_Event(e.kind, tuple(int(h) for h in e.block_hashes)) for e in events]
        with self._cond:
            for event in batch:
                self._fold(event)
            # The writer waits for a first event, then gathers for the flush interval
            # waiting only for a resync or a stop: it is woken for those, not for every
            # step's events (a wake-up per step is a thread switch and an interpreter-lock
            # hand-off taken from the engine thread, for nothing).
            wake = not self._pending
            if self._needs_resync:
                # The next write rewrites the whole set from the mirror anyway.
                wake = False
                if self._redis_down:
                    self._count_dropped(len(batch))
            elif len(self._pending) + len(batch) > self._max_pending:
                self._count_dropped(len(self._pending) + len(batch))
                self._pending.clear()
                self._needs_resync = wake = True
            else:
                self._pending.extend(batch)
            if wake:
                self._cond.notify()

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """True once everything published so far has been written (tests, shutdown)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._pending and not self._needs_resync and not self._busy, timeout
            )

    def close(self, timeout: float = 2.0) -> None:
        """Flushes what is queued (up to `timeout`) and stops the writer thread."""
        if self._thread is None:
            return
        self.wait_idle(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._thread = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- engine-thread side (under the lock) ---------------------------------------------

    def _fold(self, event: _Event) -> None:
        if event.kind == "cleared":
            self._mirror.clear()
            self._tier_mirror.clear()
        elif event.kind in SET_CHANGES:
            for blocks, add in zip((self._mirror, self._tier_mirror), SET_CHANGES[event.kind], strict=True):
                (blocks.update if add else blocks.difference_update)(event.hashes)

    def _count_dropped(self, count: int) -> None:
        self.dropped += count
        EVENTS_DROPPED.inc(count)

    # -- writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._pending or self._needs_resync)
                if self._stopping:
                    return
                if not self._needs_resync:
                    # Let the next steps' events join this batch (see the module doc).
                    self._cond.wait_for(lambda: self._stopping or self._needs_resync, self._flush_interval_s)
                snapshot = self._copy_mirror() if self._needs_resync else None
                events, self._pending = coalesce(self._pending), []
                self._needs_resync = False
                self._busy = True
            ok = self._write(snapshot, events)
            with self._cond:
                self._busy = False
                self._redis_down = not ok
                if not ok:
                    self._needs_resync = True
                self._cond.notify_all()
                if not ok:
                    self._cond.wait_for(lambda: self._stopping, self._retry_interval_s)

    def _write(self, snapshot: _Snapshot | None, events: list[_Event]) -> bool:
        """One transaction; False when Redis failed or the cursor shows lost state."""
        try:
            if snapshot is not None:
                self._write_snapshot(snapshot)
                return True
            if self._write_events(events):
                return True
            log.warning("kv events: Redis lost worker %s's block set; rewriting it", self.worker_id)
            self._write_snapshot(self._snapshot_now())
            return True
        except redis.RedisError as exc:
            count = len(events)
            self._count_dropped(count)
            log.warning("kv events: Redis unreachable (%s); dropped %d events, will resync", exc, count)
            return False

    def _snapshot_now(self) -> _Snapshot:
        with self._cond:
            # Pending events are folded into the mirror already: the snapshot covers them.
            self._pending.clear()
            return self._copy_mirror()

    def _copy_mirror(self) -> _Snapshot:
        """(every block held, those in the tier), copied (under the lock)."""
        return set(self._mirror), set(self._tier_mirror)

    def _redis(self) -> redis.Redis:
        if self._client is None:
            raise RuntimeError("KvEventPublisher.start() was not called")
        return self._client

    def _cursor(self) -> str:
        return f"{self.epoch}:{self._seq}"

    def _entry(self, kind: str, hashes: Sequence[int]) -> dict[Any, Any]:
        self._seq += 1
        return {
            "worker_id": self.worker_id,
            "epoch": self.epoch,
            "seq": self._seq,
            "kind": kind,
            "hashes": ",".join(str(h) for h in hashes),
        }

    def _write_events(self, events: list[_Event]) -> bool:
        """Appends events; False when the stored cursor was not ours (then nothing is trusted)."""
        client = self._redis()
        expected = self._cursor().encode()
        first_seq = self._seq
        pipe = client.pipeline(transaction=True)
        pipe.get(seq_key(self.worker_id))
        for event in events:
            pipe.xadd(
                STREAM_KEY, self._entry(event.kind, event.hashes), maxlen=self._maxlen, approximate=True
            )
            self._fold_into_sets(pipe, event)
        pipe.set(seq_key(self.worker_id), self._cursor())
        try:
            results = pipe.execute()
        except redis.RedisError:
            self._seq = first_seq
            raise
        self.published += len(events)
        EVENTS_PUBLISHED.inc(len(events))
        return bool(results[0] == expected)

    def _fold_into_sets(self, pipe: Any, event: _Event) -> None:
        """The event's change of the worker's index and tier sets, queued on `pipe`."""
        keys = (index_key(self.worker_id), tier_key(self.worker_id))
        if event.kind == "cleared":
            pipe.delete(*keys)
        elif event.hashes and event.kind in SET_CHANGES:
            for key, add in zip(keys, SET_CHANGES[event.kind], strict=True):
                (pipe.sadd if add else pipe.srem)(key, *event.hashes)

    def _write_snapshot(self, snapshot: _Snapshot) -> None:
        pipe = self._redis().pipeline(transaction=True)
        for key, hashes in zip((index_key(self.worker_id), tier_key(self.worker_id)), snapshot, strict=True):
            pipe.delete(key)
            members = list(hashes)
            for start in range(0, len(members), _SADD_CHUNK):
                pipe.sadd(key, *members[start : start + _SADD_CHUNK])
        pipe.xadd(STREAM_KEY, self._entry("resync", ()), maxlen=self._maxlen, approximate=True)
        pipe.set(seq_key(self.worker_id), self._cursor())
        pipe.execute()
        self.resyncs += 1
        RESYNCS.inc()
