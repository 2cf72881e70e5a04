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


def scheduler_addresses(setting: str) -> list[str]:
    """The scheduler replicas of a `scheduler_address` setting ("host:port[,host:port...]")."""
    return [part.strip() for part in setting.split(",") if part.strip()]


class SchedulerLink:
    """Keeps this worker registered with every scheduler replica it is given: each
    replica routes on its own, so each must know the worker is alive (with one address,
    e.g. a Kubernetes Service, the replicas share it through Redis)."""

    def __init__(
        self,
        scheduler_address: str,
        descriptor: scheduler_pb2.WorkerDescriptor,
        load: LoadFn,
        leases: Callable[[], list[str]] = list,
        loras: Callable[[], worker_pb2.LoraState | None] = lambda: None,
    ) -> None:
        self.descriptor = descriptor
        self._links = [
            _ReplicaLink(address, descriptor) for address in scheduler_addresses(scheduler_address)
        ]
        self._load = load
        self._leases = leases
        self._loras = loras
        self._interval_s = 0.5
        self._draining = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="scheduler-link")

    def _heartbeat(self) -> scheduler_pb2.HeartbeatRequest:
        return scheduler_pb2.HeartbeatRequest(
            worker_id=self.descriptor.worker_id,
            load=self._load(),
            draining=self._draining,
            active_lease_ids=self._leases(),
            loras=self._loras(),
        )

    async def _beat_all(self) -> None:
        request = self._heartbeat()
        intervals = await asyncio.gather(*(link.beat(request) for link in self._links))
        self._interval_s = min((i for i in intervals if i > 0), default=self._interval_s)

    async def _loop(self) -> None:
        while True:
            await self._beat_all()
            await asyncio.sleep(self._interval_s)

    async def drain(self) -> None:
        """Tells the schedulers to stop routing new requests here."""
        self._draining = True
        await self._beat_all()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for link in self._links:
            await link.close()


class _ReplicaLink:
    """Registration + heartbeats with one scheduler replica."""

    def __init__(self, address: str, descriptor: scheduler_pb2.WorkerDescriptor) -> None:
        self.address = address
        self.descriptor = descriptor
        self._channel = open_channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._registered = False

    async def beat(self, request: scheduler_pb2.HeartbeatRequest) -> float:
        """Registers if needed, then heartbeats; the replica's interval (0 if unknown)."""
        interval = 0.0
        try:
            if not self._registered:
                reply = await self._stub.RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(worker=self.descriptor), timeout=2.0
                )
                interval = reply.heartbeat_interval_ms / 1000
                self._registered = True
                log.info("registered with scheduler %s as %s", self.address, self.descriptor.worker_id)
            beat = await self._stub.Heartbeat(request, timeout=2.0)
            self._registered = beat.known
        except grpc.aio.AioRpcError as exc:
            # The replica may be restarting: keep trying, it will see us again.
            self._registered = False
            log.debug("scheduler %s unreachable: %s", self.address, exc.code())
        return interval

    async def close(self) -> None:
        await self._channel.close()
