"""Stored `/v1/responses` responses: the response object and its conversation (the input
items that led to it), per owner, so that `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}` work on any gateway replica.

With `--redis-url` the records live in Redis (`meshserve:responses:<owner>:<id>`, JSON,
expiring after `--response-ttl-s`); the owner is the caller's tenant, itself a hash of the
API key (`gateway.middleware.tenant_of`), so no raw key is stored and another key's
response is simply not found. Without Redis they live in a bounded in-process store
(`LOCAL_CAPACITY` records, the oldest dropped first), visible to this process only.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import APIError
from services import redis_client
from services.clock import Clock

log = logging.getLogger(__name__)

LOCAL_CAPACITY = 1000
_PREFIX = redis_client.KEY_PREFIX + "responses:"


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
