"""Stored `/v1/responses` responses: the response object and its conversation (the input
items that led to it), per owner, so that `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}` work on any gateway replica.

With `--redis-url` the records live in Redis (`meshserve:responses:<owner>:<id>`, JSON,
expiring after `--response-ttl-s`); the owner is the caller's tenant, itself a hash of the
API key (`gateway.middleware.tenant_of`), so no raw key is stored and another key's
response is simply not found. Without Redis they live in a bounded in-process store
(`LOCAL_CAPACITY` records, the oldest dropped first), visible to this process only.

A background response (gateway/background.py) also has an event log: its Responses
events in sequence order, then an end mark, in a Redis stream beside its record
(`<record key>:events`, entry id ``<sequence number + 1>-0``, expiring with the record), so
any replica replays them after a `starting_after` and follows the rest as they come; a
cancel is a flag beside them (`<record key>:cancel`) that the producing replica polls.
A response's events are bounded by its tokens. Without Redis the log is this process's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import APIError
from services import redis_client
from services.clock import Clock

log = logging.getLogger(__name__)

LOCAL_CAPACITY = 1000
_PREFIX = redis_client.KEY_PREFIX + "responses:"
# The end mark of an event log (no SSE event is empty).
END = b""
# The background jobs in progress ("<owner> <response id>"), over every replica.
_ACTIVE = _PREFIX + "background"
# Lease scripts: KEYS[1] the lease, ARGV[1] its holder (ARGV[2]: milliseconds to extend).
# A lease lapsed but not yet claimed by another replica is its producer's again.
_RENEW = (
    "local h = redis.call('GET', KEYS[1]) if h == false or h == ARGV[1] then "
    "return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 1 end return 0"
)
# An event logged only by the lease's holder (or while nobody holds it): a producer that
# lost the response to another replica cannot write beside the new one (a fencing check).
_APPEND = (
    "local h = redis.call('GET', KEYS[2]) if h ~= false and h ~= ARGV[4] then return 0 end "
    "redis.call('XADD', KEYS[1], ARGV[1], 'e', ARGV[2], 't', ARGV[3]) "
    "redis.call('EXPIRE', KEYS[1], ARGV[5]) return 1"
)
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# A follower's blocking read on Redis: under the client's 1 s socket timeout.
_BLOCK_MS = 500


@dataclass
class _LocalLog:
    """A background response's events in this process, and the event set at each new one."""

    events: list[bytes] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: its object (as answered) and the conversation before its output."""

    response: dict[str, Any]
    items: list[dict[str, Any]]

    def to_json(self) -> bytes:
        """The record as stored."""
        return json.dumps({"response": self.response, "items": self.items}, ensure_ascii=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredResponse:
        """A record read back."""
        record = json.loads(data)
        return cls(response=record["response"], items=record["items"])


class ResponseStore:
    """Redis-backed when `redis_url` is set, else in-process (see the module docstring)."""

    def __init__(self, redis_url: str, ttl_s: int, clock: Clock = time.monotonic) -> None:
        self.shared = bool(redis_url)
        self.ttl_s = ttl_s
        self.clock = clock  # the in-process store's expiry (Redis expires its own keys)
        self._redis = redis_client.connect(redis_url) if redis_url else None
        self._local: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._local_logs: dict[str, _LocalLog] = {}
        self._renew = self._redis.register_script(_RENEW) if self._redis is not None else None
        self._release = self._redis.register_script(_RELEASE) if self._redis is not None else None
        self._append = self._redis.register_script(_APPEND) if self._redis is not None else None
        self._local_cancels: set[str] = set()

    @staticmethod
    def key(owner: str, response_id: str) -> str:
        """The record's key: owner and response id."""
        return f"{_PREFIX}{owner}:{response_id}"

    async def put(self, owner: str, record: StoredResponse) -> None:
        """Stores (or replaces) `record` under its response id."""
        key, data = self.key(owner, record.response["id"]), record.to_json()
        if self._redis is None:
            self._local[key] = (self.clock() + self.ttl_s, data)
            self._local.move_to_end(key)
            while len(self._local) > LOCAL_CAPACITY:
                self._local.popitem(last=False)
            return
        await self._call(self._redis.set(key, data, ex=self.ttl_s))

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The caller's record, or None (unknown, expired, deleted or another owner's)."""
        key = self.key(owner, response_id)
        if self._redis is None:
            entry = self._local.get(key)
            if entry is None or entry[0] < self.clock():
                self._local.pop(key, None)
                return None
            data: bytes | None = entry[1]
        else:
            data = await self._call(self._redis.get(key))
        return StoredResponse.from_json(data) if data is not None else None

    async def delete(self, owner: str, response_id: str) -> bool:
        """Deletes the caller's record; False when there was none."""
        key = self.key(owner, response_id)
        if self._redis is None:
            return self._local.pop(key, None) is not None
        return bool(await self._call(self._redis.delete(key)))

    # -- background responses' event logs ------------------------------------------

    async def append_event(
        self, owner: str, response_id: str, sequence: int, data: bytes, holder: str, groups: bytes = b""
    ) -> bool:
        """Logs event number ``sequence`` (its SSE bytes; ``END`` after the last) with
        ``groups``, the output tokens that came since the previous event (JSON), unless a
        replica other than ``holder`` holds the response's lease (False then)."""
        key = self.key(owner, response_id) + ":events"
        if self._redis is None or self._append is None:
            if key not in self._local_logs and len(self._local_logs) >= LOCAL_CAPACITY:
                oldest = next(iter(self._local_logs))
                del self._local_logs[oldest]
                self._local_cancels.discard(oldest.removesuffix(":events") + ":cancel")
            log_ = self._local_logs.setdefault(key, _LocalLog())
            log_.events.append(data)
            log_.changed.set()
            log_.changed = asyncio.Event()
            return True
        lease = self.key(owner, response_id) + ":lease"
        args: list[bytes | str | int] = [f"{sequence + 1}-0", data, groups, holder, self.ttl_s]
        return bool(await self._call(self._append(keys=[key, lease], args=args)))

    async def log_length(self, owner: str, response_id: str) -> int:
        """How many events are logged (the next one's sequence number, before the end mark)."""
        key = self.key(owner, response_id) + ":events"
        if self._redis is None:
            return len(self._local_logs.get(key, _LocalLog()).events)
        return int(await self._call(self._redis.xlen(key)))

    async def read_log(self, owner: str, response_id: str) -> list[tuple[bytes, bytes]]:
        """Every logged event with its tokens (the end mark left out)."""
        key = self.key(owner, response_id) + ":events"
        if self._redis is None:
            return [(e, b"") for e in self._local_logs.get(key, _LocalLog()).events if e != END]
        entries = await self._call(self._redis.xrange(key))
        return [(f[b"e"], f.get(b"t", b"")) for _id, f in entries if f[b"e"] != END]

    async def follow_events(self, owner: str, response_id: str, after: int) -> AsyncIterator[bytes]:
        """The logged events after sequence number ``after`` (-1: all), then each one as
        it is logged, until the end mark."""
        key = self.key(owner, response_id) + ":events"
        if self._redis is None:
            async for data in self._follow_local(key, after):
                yield data
            return
        last = f"{after + 1}-0"
        while True:
            found = await self._call(self._redis.xread({key: last}, count=256, block=_BLOCK_MS))
            for _stream, entries in found or ():
                for entry_id, fields in entries:
                    last = entry_id
                    if fields[b"e"] == END:
                        return
                    yield fields[b"e"]

    async def _follow_local(self, key: str, after: int) -> AsyncIterator[bytes]:
        log_ = self._local_logs.setdefault(key, _LocalLog())
        index = after + 1
        while True:
            while index < len(log_.events):
                data = log_.events[index]
                index += 1
                if data == END:
                    return
                yield data
            await log_.changed.wait()

    # -- background jobs: their records, producers' leases, the set in progress -------

    async def begin_job(self, owner: str, response_id: str, job: bytes, holder: str, lease_s: float) -> None:
        """Stores a background job's record with ``holder``'s lease on it, in progress."""
        if self._redis is None:
            return
        key = self.key(owner, response_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(key + ":job", job, ex=self.ttl_s)
        pipe.set(key + ":lease", holder, px=int(lease_s * 1000))
        pipe.sadd(_ACTIVE, f"{owner} {response_id}")
        await self._call(pipe.execute())

    async def job(self, owner: str, response_id: str) -> bytes | None:
        """A background job's record (None: none, or without Redis)."""
        if self._redis is None:
            return None
        data: bytes | None = await self._call(self._redis.get(self.key(owner, response_id) + ":job"))
        return data

    async def renew_lease(self, owner: str, response_id: str, holder: str, lease_s: float) -> bool:
        """Extends ``holder``'s lease (takes it again if it lapsed unclaimed); False when
        another replica holds it."""
        if self._redis is None or self._renew is None:
            return True
        key = self.key(owner, response_id) + ":lease"
        return bool(await self._call(self._renew(keys=[key], args=[holder, int(lease_s * 1000)])))

    async def end_job(self, owner: str, response_id: str, holder: str) -> None:
        """The job has ended: out of the set in progress, ``holder``'s lease dropped."""
        if self._redis is None or self._release is None:
            return
        key = self.key(owner, response_id)
        await self._call(self._redis.srem(_ACTIVE, f"{owner} {response_id}"))
        await self._call(self._release(keys=[key + ":lease"], args=[holder]))

    async def orphaned_jobs(self, holder: str, lease_s: float) -> list[tuple[str, str]]:
        """The jobs in progress whose lease had lapsed, each now ``holder``'s (claimed)."""
        if self._redis is None:
            return []
        claimed = []
        for member in await self._call(self._redis.smembers(_ACTIVE)):
            owner, _, response_id = member.decode().partition(" ")
            lease = self.key(owner, response_id) + ":lease"
            if await self._call(self._redis.set(lease, holder, nx=True, px=int(lease_s * 1000))):
                claimed.append((owner, response_id))
        return claimed

    async def request_cancel(self, owner: str, response_id: str) -> None:
        """Flags the response for cancelling; its producing replica stops it."""
        key = self.key(owner, response_id) + ":cancel"
        if self._redis is None:
            self._local_cancels.add(key)
            return
        await self._call(self._redis.set(key, b"1", ex=self.ttl_s))

    async def cancel_requested(self, owner: str, response_id: str) -> bool:
        """Whether someone asked to cancel the response."""
        key = self.key(owner, response_id) + ":cancel"
        if self._redis is None:
            return key in self._local_cancels
        return bool(await self._call(self._redis.exists(key)))

    async def _call(self, pending: Any) -> Any:
        try:
            return await pending
        except (RedisError, OSError) as exc:
            log.warning("response store: redis failed: %s", exc)
            raise APIError(
                503, "the response store (redis) is unavailable", code="store_unavailable"
            ) from exc

    async def close(self) -> None:
        """Closes the Redis connection."""
        if self._redis is not None:
            await self._redis.aclose()
