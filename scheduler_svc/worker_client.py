"""One cached gRPC channel per worker (re-dialled when a worker re-registers elsewhere)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from meshserve.v1 import worker_pb2_grpc
from services.rpc import open_channel

log = logging.getLogger(__name__)


class WorkerChannels:
    """worker_id → (address, channel, stub); closed channels of replaced addresses linger
    `grace_s` so calls still in flight on them end on their own."""

    def __init__(self, max_message_bytes: int, grace_s: float = 5.0) -> None:
        self._max_message_bytes = max_message_bytes
        self._grace_s = grace_s
        self._entries: dict[str, tuple[str, grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def stub(self, worker_id: str, address: str) -> worker_pb2_grpc.WorkerStub:
        """The stub for `worker_id` at `address`, dialling (lazily) on first use."""
        entry = self._entries.get(worker_id)
        if entry is not None and entry[0] == address:
            return entry[2]
        if entry is not None:
            self._close_later(entry[1])
        channel = open_channel(address, self._max_message_bytes)
        stub = worker_pb2_grpc.WorkerStub(channel)
        self._entries[worker_id] = (address, channel, stub)
        return stub

    def drop(self, worker_id: str) -> None:
        """Forgets a worker's channel (closed after the grace period)."""
        entry = self._entries.pop(worker_id, None)
        if entry is not None:
            self._close_later(entry[1])

    async def close(self) -> None:
        entries = list(self._entries.values())
        self._entries.clear()
        for _address, channel, _stub in entries:
            await channel.close(grace=None)
        for task in list(self._closing):
            task.cancel()

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(grace=self._grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
