"""Real gRPC schedulers and small in-process fake workers (real gRPC servers, scripted
heartbeats and failures) for the scheduler's integration tests.

The scheduler only routes: `RunningScheduler.route` returns the lease and worker a
route on its RouteStream picks; `RunningScheduler.run` plays the gateway in miniature
(route, then the request on the chosen worker's `Worker.GenerateStream`, then release)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
import pytest

from meshserve.v1 import (
    common_pb2,
    kv_transfer_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.servicer import SchedulerServicer
from services.clock import Clock
from services.kv_contract import request_extra_keys
from services.kv_hash import block_hashes
from services.server import GrpcServer
from services.worker_roles import role_value
from tests.scheduler_svc.route_client import ReleaseCounter, RouteClient, release_counted
from tests.worker_svc.worker_kit import generate_one
from worker_svc.kv_events import KvEventPublisher

FAST = {"heartbeat_interval_ms": 100, "worker_timeout_s": 0.5, "worker_forget_s": 5.0, "block_size": 4}


@dataclasses.dataclass
class KvEvent:
    kind: str
    block_hashes: list[int]


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A decoder (or embedding) worker on a real gRPC server, heartbeating every 100 ms.

    Heartbeats report the load, `draining`, and as active leases the ids in `lease_ids`
    (set by the test) plus the leases of the requests its `GenerateStream` is running.
    `hang()` stops the heartbeats (the server keeps answering), `resume()` restarts them,
    `kill()` stops everything at once (kill -9). `fail_first` makes Embed fail UNAVAILABLE.
    Clearing `finish` holds every request before its last token until it is set again.

    The scheduler never calls a decoder's GenerateStream; the tests do, after a route, as
    the gateway would. Each request added streams `tokens` deterministic tokens (token i
    of a request is `(sum(prompt) + i) % 1000`) and, with a Redis URL, publishes the
    prompt's full blocks as KV events like the engine.
    """

    def __init__(
        self,
        worker_id: str,
        model: str = "m",
        role: str = "decoder",
        tokens: int = 4,
        delay: float = 0.005,
        block_size: int = 4,
        max_num_seqs: int = 8,
        redis_url: str = "",
        kv_layout: kv_transfer_pb2.KvLayout | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.kv_layout = kv_layout
        self.model = model
        self.role = role
        self.tokens = tokens
        self.delay = delay
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.fail_first = False
        self.finish = asyncio.Event()
        self.finish.set()
        self.draining = False
        self.heartbeating = True
        # Lease ids the heartbeats report besides those of running requests.
        self.lease_ids: set[str] = set()
        # More LoadStats fields the heartbeats report (set by the test).
        self.reported: dict[str, float] = {}
        # Heartbeats the scheduler answered.
        self.beats = 0
        self.started: list[str] = []
        self.active: dict[str, str] = {}  # request_id -> lease_id of running requests
        self.publisher = KvEventPublisher(redis_url, worker_id)
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._channel: grpc.aio.Channel | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._beaten = asyncio.Condition()

    async def start(self, scheduler_address: str | None = None) -> FakeWorker:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()
        self.publisher.start()
        if scheduler_address:
            await self.connect(scheduler_address)
        return self

    def descriptor(self) -> scheduler_pb2.WorkerDescriptor:
        return scheduler_pb2.WorkerDescriptor(
            worker_id=self.worker_id,
            address=self.address,
            role=role_value(self.role),
            model=self.model,
            max_model_len=4096,
            block_size=self.block_size,
            num_total_blocks=1000,
            max_num_seqs=self.max_num_seqs,
            kv_layout=self.kv_layout,
        )

    async def connect(self, scheduler_address: str) -> None:
        """Registers and starts heartbeating every 100 ms (re-registering when unknown)."""
        self._channel = grpc.aio.insecure_channel(scheduler_address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        await self._stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=self.descriptor()))
        self._heartbeat = asyncio.create_task(self._beat())

    def active_lease_ids(self) -> list[str]:
        return sorted(self.lease_ids | {lease for lease in self.active.values() if lease})

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if not self.heartbeating:
                continue
            load = worker_pb2.LoadStats(num_running=len(self.active), num_total_blocks=1000, **self.reported)
            request = scheduler_pb2.HeartbeatRequest(
                worker_id=self.worker_id,
                load=load,
                draining=self.draining,
                active_lease_ids=self.active_lease_ids(),
            )
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await self._stub.Heartbeat(request)
                async with self._beaten:
                    self.beats += 1
                    self._beaten.notify_all()
                if not reply.known:
                    await self._stub.RegisterWorker(
                        scheduler_pb2.RegisterWorkerRequest(worker=self.descriptor())
                    )

    async def wait_beats(self, count: int, timeout: float = 10.0) -> None:
        """Waits until `count` more heartbeats have been answered."""
        target = self.beats + count
        async with asyncio.timeout(timeout), self._beaten:
            await self._beaten.wait_for(lambda: self.beats >= target)

    def hang(self) -> None:
        """Stops heartbeating (a hung process: the server still accepts calls)."""
        self.heartbeating = False

    def resume(self) -> None:
        self.heartbeating = True

    async def kill(self) -> None:
        """Stops serving and heartbeating at once (like kill -9)."""
        self.heartbeating = False
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        server, self.server = self.server, None
        if server is not None:
            # A second stop of a stopped aio server raises CancelledError: stop once.
            await server.stop(0)

    async def close(self) -> None:
        await self.kill()
        if self._heartbeat is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._channel is not None:
            await self._channel.close()
        await asyncio.to_thread(self.publisher.close)

    def prompt_hashes(
        self, token_ids: list[int], cache_salt: str = "", mm_ids: tuple[str, ...] = ()
    ) -> list[int]:
        """The block hashes this worker publishes for a prompt (same keys as the engine)."""
        items = [common_pb2.MultiModalItem(identifier=i, offset=n) for n, i in enumerate(mm_ids)]
        return block_hashes(token_ids, self.block_size, request_extra_keys(cache_salt, items))

    async def GenerateStream(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        """Runs each request added (aborts are ignored); one message per output."""
        out: asyncio.Queue[Any] = asyncio.Queue()
        runs: set[asyncio.Task[None]] = set()

        async def run(request: Any) -> None:
            async for response in self._generate(request):
                out.put_nowait(worker_pb2.GenerateStreamResponse(outputs=[response]))

        async def read() -> None:
            async for message in requests:
                if message.HasField("add"):
                    runs.add(asyncio.create_task(run(message.add)))
            await asyncio.gather(*runs, return_exceptions=True)
            out.put_nowait(None)  # half-closed and every request done: the call ends

        reader = asyncio.create_task(read())
        try:
            while (message := await out.get()) is not None:
                yield message
        finally:
            reader.cancel()
            for task in runs:
                task.cancel()

    async def _generate(self, request: Any) -> AsyncIterator[Any]:
        rid = request.request_id
        self.started.append(rid)
        self.active[rid] = request.lease_id
        mm_ids = tuple(m.identifier for m in request.mm_items)
        hashes = self.prompt_hashes(list(request.prompt_token_ids), request.cache_salt, mm_ids)
        self.publisher.publish([KvEvent("stored", hashes)])
        limit = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else self.tokens
        base = sum(request.prompt_token_ids)
        try:
            for i in range(limit):
                await asyncio.sleep(self.delay)
                last = i == limit - 1
                if last:
                    await self.finish.wait()
                yield common_pb2.GenerateResponse(
                    request_id=rid,
                    deltas=[
                        common_pb2.SequenceDelta(
                            index=0,
                            token_ids=[(base + i) % 1000],
                            finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                        )
                    ],
                    usage=common_pb2.Usage(
                        prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1
                    )
                    if last
                    else None,
                    finished=last,
                    worker_id=self.worker_id if i == 0 else "",
                )
        finally:
            self.active.pop(rid, None)

    async def Embed(self, request: Any, context: Any) -> Any:
        self.started.append(request.request_id)
        if self.fail_first:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is broken")
        vectors = [common_pb2.Embedding(values=[float(len(text)), 1.0]) for text in request.inputs]
        return common_pb2.EmbedResponse(embeddings=vectors, prompt_tokens=len(request.inputs))


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
