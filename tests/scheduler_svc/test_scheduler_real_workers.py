"""The scheduler in front of real decoder worker processes (tiny model, CPU) and a real
redis-server: requests are routed by the scheduler (on a RouteStream), then run on the
chosen worker's Worker.GenerateStream and released, as the gateway does. Prefix affinity
from the engine's KV events; after `kill -9` of a worker the caller fails over (routes
excluding it) and, once its heartbeats stop, the scheduler routes nothing there.

Slow (model build + worker start-up): run with `make soak` / `pytest -m slow`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from meshserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.servicer import SchedulerServicer
from services.redis_client import RedisServer
from services.server import GrpcServer
from tests.mesh import RunningMesh, mesh_config, start_mesh
from tests.scheduler_svc.route_client import ReleaseCounter, RouteClient, release_counted
from tests.worker_svc.worker_kit import generate_one

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny"
WORKERS = ("decoder-0", "decoder-1")


class RealWorkers:
    """Redis + an in-process scheduler (its registry and prefix index in reach) + decoder
    worker processes started by the test mesh helper."""

    def __init__(self, model_dir: Path, redis: RedisServer, base: Path, policy: str = "prefix") -> None:
        self.config = mesh_config(
            base,
            only="decoder",
            model_dir=str(model_dir),
            served_model_name=MODEL,
            num_decoders=len(WORKERS),
            redis_url=redis.url,
            max_num_seqs=8,
            extra_env=(("MESHSERVE_NUM_KV_BLOCKS", "256"), ("MESHSERVE_NUM_THREADS", "1")),
        )
        self.policy = policy
        self.workers: RunningMesh | None = None
        self.worker_channels: dict[str, grpc.aio.Channel] = {}

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        """The worker processes by worker id."""
        return self.workers.procs if self.workers is not None else {}

    async def start(self) -> None:
        """The scheduler on the port the workers are told, then the workers, registered."""
        config = SchedulerConfig(
            port=self.config.scheduler_port, redis_url=self.config.redis_url, heartbeat_interval_ms=200,
            worker_timeout_s=1.5, routing_policy=self.policy,
        )  # fmt: skip
        self.core = Scheduler(config)
        self.server = GrpcServer(f"scheduler-{self.policy}", config)
        servicer = SchedulerServicer(self.core)
        self.server.add_service(
            "meshserve.v1.Scheduler", scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer
        )
        self.releases = ReleaseCounter(servicer.router)
        await self.core.start()
        self.address = f"127.0.0.1:{await self.server.start()}"
        await self.server.set_serving(True)
        self.channel = grpc.aio.insecure_channel(self.address)
        self.routes = RouteClient(self.channel)
        # Blocking waits (health checks on their own loop): off this loop, which serves the scheduler.
        self.workers = await asyncio.to_thread(start_mesh, self.config, 180.0)
        await self.wait_registered(WORKERS)

    async def wait_registered(self, worker_ids: tuple[str, ...], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all((w := self.core.registry.get(i)) is not None and w.healthy for i in worker_ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {worker_ids} did not register")
            await asyncio.sleep(0.1)

    def request(self, prompt: list[int], max_tokens: int = 4, **fields: Any) -> common_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return common_pb2.GenerateRequest(model=MODEL, prompt_token_ids=prompt, sampling=sampling, **fields)

    async def route(
        self, request: common_pb2.GenerateRequest, exclude: tuple[str, ...] = ()
    ) -> scheduler_pb2.RouteResponse:
        """A route on the RouteStream; the request takes the route's request and lease ids."""
        reply = await self.routes.route(request, exclude, timeout=60)
        request.request_id, request.lease_id = reply.request_id, reply.lease_id
        return reply

    def worker_stub(self, route: scheduler_pb2.RouteResponse) -> worker_pb2_grpc.WorkerStub:
        channel = self.worker_channels.get(route.worker_address)
        if channel is None:
            channel = self.worker_channels[route.worker_address] = grpc.aio.insecure_channel(
                route.worker_address
            )
        return worker_pb2_grpc.WorkerStub(channel)

    async def release(self, *lease_ids: str) -> int:
        """Releases on the RouteStream; once handled, how many leases the scheduler ended."""
        return await release_counted(self.routes, self.releases, *lease_ids)

    async def generate(self, prompt: list[int], max_tokens: int = 4, **fields: Any) -> list[Any]:
        """Route, the request on the routed worker's GenerateStream, release."""
        request = self.request(prompt, max_tokens, **fields)
        route = await self.route(request)
        try:
            responses = [r async for r in generate_one(self.worker_stub(route), request, 60)]
        finally:
            await self.release(route.lease_id)
        assert responses[0].worker_id == route.worker_id
        return responses

    async def close(self) -> None:
        if self.workers is not None:
            await asyncio.to_thread(self.workers.stop)
        for channel in self.worker_channels.values():
            await channel.close()
        await self.routes.close()
        await self.channel.close()
        await self.server.server.stop(0)
        await self.core.stop()


@pytest.fixture(scope="module")
def module_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mesh(
    tiny_model_dir: Path, module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RealWorkers]:
    mesh = RealWorkers(tiny_model_dir, module_redis, tmp_path_factory.mktemp("real-workers"))
    try:
        await mesh.start()
        yield mesh
    finally:
        await mesh.close()


def tokens(responses: list[Any]) -> list[int]:
    return [t for r in responses for d in r.deltas for t in d.token_ids]


@pytest.mark.asyncio(loop_scope="session")
async def test_routed_requests_and_prefix_affinity(mesh: RealWorkers) -> None:
    system = [(7 * i) % 500 + 3 for i in range(64)]  # 4 blocks of 16
    first = await mesh.generate([*system, 11, 12], max_tokens=6)
    assert len(tokens(first)) == 6 and first[-1].finished
    owner = first[0].worker_id
    assert owner in WORKERS
    # The engine's KV events reach the index through Redis.
    deadline = time.monotonic() + 10
    while mesh.core.index.num_blocks(owner) < 4:
        assert time.monotonic() < deadline, "KV events did not reach the scheduler"
        await asyncio.sleep(0.05)
    # Let the routing-time speculation expire: affinity below comes from KV events only.
    await asyncio.sleep(mesh.core.config.speculative_ttl_s)
    # Follow-up turns share the prefix: same worker, served from its prefix cache.
    for turn in range(3):
        follow = await mesh.generate([*system, 11, 12, 40 + turn, 41, 42], max_tokens=3)
        assert follow[0].worker_id == owner
        assert follow[-1].usage.cached_tokens >= 64
    # Greedy decoding of the same prompt gives the same tokens on either worker.
    again = await mesh.generate([*system, 11, 12], max_tokens=6)
    assert tokens(again) == tokens(first)


@pytest.mark.asyncio(loop_scope="session")
async def test_kill_9_worker_mid_stream(mesh: RealWorkers) -> None:
    request = mesh.request(list(range(5, 40)), max_tokens=2000)
    route = await mesh.route(request)
    victim = route.worker_id
    received = 0
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in generate_one(mesh.worker_stub(route), request, 60):
            received += sum(len(d.token_ids) for d in response.deltas)
            if received >= 3 and mesh.procs[victim].poll() is None:
                os.kill(mesh.procs[victim].pid, signal.SIGKILL)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 30
    survivor = next(w for w in WORKERS if w != victim)
    # The caller fails over at once (before the heartbeat timeout): routes again without
    # the dead worker, run the request there.
    retry = mesh.request(list(range(5, 40)), max_tokens=3)
    failover = await mesh.route(retry, exclude=(victim,))
    assert failover.worker_id == survivor
    responses = [r async for r in generate_one(mesh.worker_stub(failover), retry, 60)]
    assert responses[-1].finished and len(tokens(responses)) == 3
    await mesh.release(failover.lease_id)
    # Its heartbeats stopped: the scheduler marks it down, ends its leases (the killed
    # request's was never released) and drops its prefix index entries ...
    deadline = time.monotonic() + 10
    while mesh.core.registry.get(victim).healthy:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "dead worker never marked down"
        await asyncio.sleep(0.1)
    assert mesh.core.registry.get(victim).inflight == 0  # type: ignore[union-attr]
    assert await mesh.release(route.lease_id) == 0
    assert mesh.core.index.num_blocks(victim) == 0
    # ... and routes nothing there any more, even the prompt it had cached.
    for prompt in ([100 + i] * 20 for i in range(4)):
        responses = await mesh.generate(prompt, max_tokens=2)
        assert responses[0].worker_id == survivor and responses[-1].finished
    routed = await mesh.route(mesh.request(list(range(5, 40))))
    assert routed.worker_id == survivor
    await mesh.release(routed.lease_id)


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("policy", ["round_robin", "least_load"])
async def test_policy_serves_and_spreads_over_real_workers(
    policy: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each non-default policy routes real requests to both real workers.

    Its own Redis: the registry is shared through Redis, so with the module's Redis this
    scheduler would also see (and rightly use) the module mesh's surviving worker."""
    redis = RedisServer().start()
    mesh = RealWorkers(tiny_model_dir, redis, tmp_path_factory.mktemp(f"{policy}-workers"), policy)
    try:
        await mesh.start()
        prompts = [[(13 * i + j) % 500 + 3 for j in range(20)] for i in range(8)]
        results = await asyncio.gather(*(mesh.generate(p, max_tokens=4) for p in prompts))
        assert all(len(tokens(r)) == 4 and r[-1].finished for r in results)
        used = {r[0].worker_id for r in results}
        assert used == set(WORKERS), f"{policy} used only {used}"
    finally:
        await mesh.close()
        redis.cleanup()
