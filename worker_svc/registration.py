"""Worker ↔ scheduler membership: register at start-up, heartbeat with load stats,
re-register when the scheduler forgets us (e.g. it restarted), announce draining."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.rpc import open_channel

log = logging.getLogger(__name__)

LoadFn = Callable[[], worker_pb2.LoadStats]


class SchedulerLink:
    """Keeps this worker registered with the global scheduler."""

    def __init__(
        self, scheduler_address: str, descriptor: scheduler_pb2.WorkerDescriptor, load: LoadFn
    ) -> None:
        self.descriptor = descriptor
        self._load = load
        self._channel = open_channel(scheduler_address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._interval_s = 0.5
        self._registered = False
        self._draining = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="scheduler-link")

    async def _register(self) -> None:
        reply = await self._stub.RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(worker=self.descriptor), timeout=2.0
        )
        if reply.heartbeat_interval_ms > 0:
            self._interval_s = reply.heartbeat_interval_ms / 1000
        self._registered = True
        log.info("registered with scheduler as %s", self.descriptor.worker_id)

    async def _beat(self) -> None:
        request = scheduler_pb2.HeartbeatRequest(
            worker_id=self.descriptor.worker_id, load=self._load(), draining=self._draining
        )
        reply = await self._stub.Heartbeat(request, timeout=2.0)
        if not reply.known:
            self._registered = False

    async def _loop(self) -> None:
        while True:
            try:
                if not self._registered:
                    await self._register()
                await self._beat()
            except grpc.aio.AioRpcError as exc:
                # The scheduler may be restarting: keep trying, it will see us again.
                self._registered = False
                log.debug("scheduler unreachable: %s", exc.code())
            await asyncio.sleep(self._interval_s)

    async def drain(self) -> None:
        """Tells the scheduler to stop routing new requests here."""
        self._draining = True
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._beat()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._channel.close()
