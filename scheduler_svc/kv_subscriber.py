"""Follows the workers' KV events in Redis and keeps the `PrefixIndex` up to date.

On start-up, and whenever Redis comes back after an error, the index is rebuilt: the
stream's last id is noted, then every tracked worker is reloaded from its block set
(set + cursor read in one transaction), then the stream is followed with XREAD from the
noted id. Entries already covered by a snapshot are skipped by their per-worker `seq`; a
gap in `seq`, a new epoch (worker restart) or a ``resync`` entry reloads that worker.
Only workers the registry tracks (registered and healthy) are indexed: `request_resync`
loads a worker that (re)appears, `PrefixIndex.remove_worker` drops one that goes down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from scheduler_svc import metrics
from scheduler_svc.prefix_index import ApplyResult, KvRecord, PrefixIndex
from services.kv_contract import (
    SEQ_KEY_PREFIX,
    STREAM_KEY,
    SUBSCRIBER_POLL_INTERVAL_MS,
    index_key,
    seq_key,
    tier_key,
)

log = logging.getLogger(__name__)

_BLOCK_MS = 300
_BATCH = 1000
# Events wait at most this long to be read in a batch; the policy meanwhile counts its own
# recent decisions as cached (speculative_ttl_s), so routing does not miss them.
_MIN_POLL_INTERVAL_S = SUBSCRIBER_POLL_INTERVAL_MS / 1000


def parse_entry(fields: dict[Any, Any]) -> KvRecord:
    """A stream entry's fields (bytes) as a KvRecord; ValueError when malformed."""
    text = {_str(k): _str(v) for k, v in fields.items()}
    try:
        hashes = tuple(int(h) for h in text.get("hashes", "").split(",") if h)
        return KvRecord(text["worker_id"], text.get("epoch", ""), int(text["seq"]), text["kind"], hashes)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"malformed KV event {text!r}: {exc}") from exc


def parse_cursor(raw: Any) -> tuple[str, int]:
    """`"epoch:seq"` → (epoch, seq); ("", 0) when absent."""
    if raw is None:
        return "", 0
    epoch, _, seq = _str(raw).rpartition(":")
    return epoch, int(seq or 0)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class KvSubscriber:
    """Background task feeding a PrefixIndex from Redis."""

    def __init__(
        self,
        client: aioredis.Redis,
        index: PrefixIndex,
        tracked: Callable[[str], bool],
        retry_interval_s: float = 1.0,
    ) -> None:
        self._client = client
        self._index = index
        self._tracked = tracked
        self._retry_interval_s = retry_interval_s
        self._last_id = "0-0"
        self._pending_resync: set[str] = set()
        self.connected = False
        self.rebuilds = 0
        self.ready = asyncio.Event()

    def request_resync(self, worker_id: str) -> None:
        """Reload `worker_id` from its block set at the next opportunity."""
        self._pending_resync.add(worker_id)

    async def run(self) -> None:
        """Rebuild, then follow the stream; on Redis errors wait and rebuild again."""
        while True:
            try:
                await self.rebuild()
                await self._follow()
            except (RedisError, OSError) as exc:
                if self.connected:
                    log.warning("kv subscriber: Redis unreachable (%s); routing on local state", exc)
            except Exception:
                log.exception("kv subscriber failed; rebuilding")
            self._set_connected(False)
            await asyncio.sleep(self._retry_interval_s)

    async def _follow(self) -> None:
        """Polls the stream for ever, at most one XREAD per `_MIN_POLL_INTERVAL_S` while
        events keep coming: at a steady trickle (one event per request) each read would
        otherwise carry one entry, and the round trip, not the event, would cost the CPU."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            if await self.poll_once():
                await asyncio.sleep(max(0.0, _MIN_POLL_INTERVAL_S - (loop.time() - started)))

    async def rebuild(self) -> None:
        """Reloads every tracked worker from Redis and positions the stream cursor."""
        self._last_id = await self._stream_last_id()
        workers = await self._workers_in_redis()
        self._pending_resync.clear()
        for worker_id in self._index.workers():
            if worker_id not in workers:
                self._index.remove_worker(worker_id)
        for worker_id in sorted(workers):
            if self._tracked(worker_id):
                await self.resync(worker_id)
        self.rebuilds += 1
        self._set_connected(True)
        log.info("kv subscriber: prefix index rebuilt (%d workers)", len(self._index.workers()))

    async def poll_once(self, block_ms: int = _BLOCK_MS) -> int:
        """Handles pending resyncs and one XREAD batch; returns the number of entries read."""
        while self._pending_resync:
            worker_id = self._pending_resync.pop()
            if self._tracked(worker_id):
                await self.resync(worker_id)
        reply: Any = await self._client.xread({STREAM_KEY: self._last_id}, count=_BATCH, block=block_ms)
        count = 0
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._last_id = _str(entry_id)
                count += 1
                await self._handle(fields)
        return count

    async def resync(self, worker_id: str) -> None:
        """Replaces the index's view of one worker with its block sets in Redis."""
        pipe = self._client.pipeline(transaction=True)
        pipe.smembers(index_key(worker_id))
        pipe.smembers(tier_key(worker_id))
        pipe.get(seq_key(worker_id))
        members, tier_members, raw_cursor = await pipe.execute()
        try:
            epoch, seq = parse_cursor(raw_cursor)
            hashes = [int(m) for m in members]
            tiered = [int(m) for m in tier_members]
        except ValueError as exc:
            log.warning("kv subscriber: malformed block set of %s (%s); ignoring it", worker_id, exc)
            epoch, seq, hashes, tiered = "", 0, [], []
        self._index.reset_worker(worker_id, hashes, epoch, seq, tiered)
        metrics.KV_RESYNCS.inc()

    async def _handle(self, fields: dict[Any, Any]) -> None:
        try:
            record = parse_entry(fields)
        except ValueError as exc:
            log.warning("kv subscriber: skipping %s", exc)
            return
        if not self._tracked(record.worker_id):
            return
        result = self._index.apply(record)
        metrics.KV_EVENTS.labels(result=result.value).inc()
        if result is ApplyResult.RESYNC:
            await self.resync(record.worker_id)

    async def _stream_last_id(self) -> str:
        try:
            info: dict[Any, Any] = await self._client.xinfo_stream(STREAM_KEY)
        except ResponseError:  # no such key yet
            return "0-0"
        return _str(info.get("last-generated-id") or info.get(b"last-generated-id") or "0-0")

    async def _workers_in_redis(self) -> set[str]:
        workers: set[str] = set()
        async for key in self._client.scan_iter(match=SEQ_KEY_PREFIX + "*", count=500):
            workers.add(_str(key)[len(SEQ_KEY_PREFIX) :])
        return workers

    def _set_connected(self, connected: bool) -> None:
        self.connected = connected
        metrics.REDIS_UP.set(1 if connected else 0)
        if connected:
            self.ready.set()
        else:
            self.ready.clear()
