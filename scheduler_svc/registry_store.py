"""Mirrors the worker registry in Redis so several scheduler replicas share it.

Hash ``meshserve:workers``: field = worker_id, value = JSON with the worker's spec, last
load, draining flag and ``ts`` (wall-clock time of the last registration/heartbeat this
replica received). Each replica writes the workers that heartbeat to it and merges the
others' entries; an entry's age (now - ts) stands in for a TTL: entries older than the
worker timeout are ignored, older than the forget time are deleted together with the
worker's KV block set.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis

from scheduler_svc.registry import LoadSnapshot, WorkerRegistry, WorkerSpec, WorkerState
from services.kv_contract import index_key, seq_key, tier_key

log = logging.getLogger(__name__)

WORKERS_KEY = "meshserve:workers"


def encode_state(state: WorkerState, wall_ts: float) -> str:
    return json.dumps(
        {
            "spec": dataclasses.asdict(state.spec),
            "load": dataclasses.asdict(state.load),
            "draining": state.draining,
            "ts": wall_ts,
        },
        separators=(",", ":"),
    )


def decode_state(raw: bytes | str) -> tuple[WorkerSpec, LoadSnapshot, bool, float]:
    """(spec, load, draining, ts); ValueError when the entry is malformed."""
    try:
        data: dict[str, Any] = json.loads(raw)
        spec = WorkerSpec(**data["spec"])
        load = LoadSnapshot(**data["load"])
        return spec, load, bool(data["draining"]), float(data["ts"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed worker entry: {exc}") from exc


class RegistryMirror:
    """Writes local registry changes to Redis and merges other replicas' entries."""

    def __init__(
        self,
        client: aioredis.Redis,
        registry: WorkerRegistry,
        forget_s: float,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._registry = registry
        self._forget_s = forget_s
        self._wall = wall_clock

    async def sync(self, dirty: Iterable[str]) -> list[str]:
        """Writes `dirty` workers, reads everyone; returns ids of workers learnt or revived."""
        now = self._wall()
        pipe = self._client.pipeline(transaction=False)
        for worker_id in dirty:
            state = self._registry.get(worker_id)
            if state is not None:
                pipe.hset(WORKERS_KEY, worker_id, encode_state(state, now - self._age(state)))
        pipe.hgetall(WORKERS_KEY)
        results = await pipe.execute()
        return await self._merge(results[-1], now)

    def _age(self, state: WorkerState) -> float:
        return max(self._registry.now() - state.last_seen, 0.0)

    async def _merge(self, entries: dict[Any, Any], now: float) -> list[str]:
        changed: list[str] = []
        stale: list[str] = []
        for raw_id, raw in entries.items():
            worker_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            try:
                spec, load, draining, ts = decode_state(raw)
            except ValueError as exc:
                log.warning("registry mirror: dropping %s: %s", worker_id, exc)
                stale.append(worker_id)
                continue
            age = now - ts
            if age > self._forget_s:
                stale.append(worker_id)
                continue
            before = self._registry.get(worker_id)
            was_routable = before is not None and before.healthy
            if self._registry.observe_remote(spec, load, draining, age) and not was_routable:
                changed.append(worker_id)
        if stale:
            await self.forget(stale)
        return changed

    async def forget(self, worker_ids: list[str]) -> None:
        """Deletes long-gone workers' registry entries and KV block sets."""
        pipe = self._client.pipeline(transaction=False)
        pipe.hdel(WORKERS_KEY, *worker_ids)
        for worker_id in worker_ids:
            pipe.delete(index_key(worker_id), tier_key(worker_id), seq_key(worker_id))
        await pipe.execute()
