"""Real gRPC schedulers and in-process fake workers (tests/fake_worker.py's `FakeWorker` on
real gRPC servers, heartbeating every 100 ms, with the deterministic counting script) for
the scheduler's integration tests.

The scheduler only routes: `RunningScheduler.route` returns the lease and worker a
route on its RouteStream picks; `RunningScheduler.run` plays the gateway in miniature
(route, then the request on the chosen worker's `Worker.GenerateStream`, then release)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
import pytest

from meshserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.servicer import SchedulerServicer
from services.clock import Clock
from services.server import GrpcServer
from tests.fake_worker import FakeWorker
from tests.scheduler_svc.route_client import ReleaseCounter, RouteClient, release_counted
from tests.worker_svc.worker_kit import generate_one

FAST = {"heartbeat_interval_ms": 100, "worker_timeout_s": 0.5, "worker_forget_s": 5.0, "block_size": 4}


def generate_request(prompt: list[int], **fields: Any) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(model=fields.pop("model", "m"), prompt_token_ids=prompt, **fields)


@dataclasses.dataclass
class RunningScheduler:
    core: Scheduler
    server: GrpcServer
    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    servicer: SchedulerServicer
    routes: RouteClient
    releases: ReleaseCounter

    async def stop(self) -> None:
        await self.routes.close()
        await self.channel.close()
        await self.server.server.stop(0)
        await self.core.stop()

    async def wait_heartbeat(self, worker_id: str, timeout: float = 10.0) -> None:
        """Waits for a heartbeat of `worker_id` handled at the scheduler clock's present
        time or later (with a fake clock: after its last advance)."""
        since = self.core.registry.now()

        def beaten() -> bool:
            state = self.core.registry.get(worker_id)
            return state is not None and state.last_seen >= since

        await self.wait_for(beaten, timeout)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("condition not reached")
            await asyncio.sleep(0.02)

    async def route(
        self,
        prompt: list[int],
        exclude: Iterable[str] = (),
        force_encode: bool = False,
        timeout: float = 20,
        **fields: Any,
    ) -> scheduler_pb2.RouteResponse:
        """A route on the RouteStream for a GenerateRequest built from `prompt` and
        `fields` (model "m"); a refused one raises its grpc.aio.AioRpcError."""
        return await self.routes.route(generate_request(prompt, **fields), exclude, force_encode, timeout)

    async def release(self, *lease_ids: str) -> int:
        """Releases on the RouteStream; once the replica handled it, the number of the
        leases it knew and ended."""
        return await release_counted(self.routes, self.releases, *lease_ids)

    def inflight(self, worker_id: str) -> int:
        state = self.core.registry.get(worker_id)
        assert state is not None, f"unknown worker {worker_id}"
        return state.inflight

    def lease_ids(self) -> set[str]:
        """Ids of the leases this replica holds now."""
        return set(self.core.leases._leases)

    async def run(
        self, prompt: list[int], **fields: Any
    ) -> tuple[scheduler_pb2.RouteResponse, list[common_pb2.GenerateResponse]]:
        """The gateway in miniature: route, the request on the chosen worker, release."""
        route = await self.route(prompt, **fields)
        request = generate_request(prompt, **fields)
        request.request_id = route.request_id
        request.lease_id = route.lease_id
        request.ClearField("mm_items")
        request.mm_items.extend(route.mm_items)
        try:
            async with grpc.aio.insecure_channel(route.worker_address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                responses = [r async for r in generate_one(stub, request, timeout=20)]
        finally:
            await self.release(route.lease_id)
        return route, responses


SchedulerFactory = Callable[..., Awaitable[RunningScheduler]]
WorkerFactory = Callable[..., Awaitable[FakeWorker]]


async def serve_scheduler(clock: Clock = time.monotonic, **overrides: Any) -> RunningScheduler:
    """A real scheduler server on 127.0.0.1:0 with the FAST settings (stop it with `stop`);
    `clock` drives its time windows (lease TTL and grace, heartbeat staleness)."""
    config = SchedulerConfig(port=0, **{**FAST, **overrides})
    core = Scheduler(config, clock)
    server = GrpcServer("scheduler-test", config)
    servicer = SchedulerServicer(core)
    server.add_service("meshserve.v1.Scheduler", scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)
    server.on_drain(servicer.on_drain)
    await core.start()
    port = await server.start()
    await server.set_serving(True)
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    routes = RouteClient(channel, address)
    return RunningScheduler(
        core, server, address, channel, stub, servicer, routes, ReleaseCounter(servicer.router)
    )


@pytest.fixture
async def start_scheduler() -> AsyncIterator[SchedulerFactory]:
    """Starts real scheduler servers on 127.0.0.1:0 (stopped after the test)."""
    started: list[RunningScheduler] = []

    async def factory(clock: Clock = time.monotonic, **overrides: Any) -> RunningScheduler:
        running = await serve_scheduler(clock, **overrides)
        started.append(running)
        return running

    yield factory
    for running in started:
        await running.stop()


@pytest.fixture
async def start_worker() -> AsyncIterator[WorkerFactory]:
    """Starts fake workers (registered with `scheduler` when given)."""
    started: list[FakeWorker] = []

    async def factory(worker_id: str, scheduler: RunningScheduler | None = None, **kwargs: Any) -> FakeWorker:
        worker = FakeWorker(worker_id, **kwargs)
        started.append(worker)
        return await worker.start(scheduler.address if scheduler else None)

    yield factory
    for worker in started:
        await worker.close()
