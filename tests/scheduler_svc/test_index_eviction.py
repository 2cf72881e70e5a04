"""The prefix index follows a worker's cache through evictions: a real decoder (engine,
gRPC server, KV-event publisher) with a small KV cache, a real redis-server and the
scheduler (routes and releases on a RouteStream, KV subscriber). Prompts fill the cache past its
capacity so the block manager evicts; removed-block events must reach the index, and the
index's view of the worker must equal the block manager's cached hashes.

The worker runs in this process (not as a subprocess) so the test can read its block
manager; everything between the two still goes through gRPC and Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from meshserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.servicer import SchedulerServicer
from services.kv_hash import block_hashes
from services.redis_client import RedisServer
from services.server import GrpcServer
from tests.scheduler_svc.route_client import ReleaseCounter, RouteClient, release_counted
from tests.worker_svc.worker_kit import generate_one, worker_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = "evict-w0"
BLOCK = 16
NUM_BLOCKS = 24  # a few prompts' worth: the 12 prompts below need ~60 blocks


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


class Stack:
    """In-process scheduler + worker, linked by gRPC and Redis."""

    def __init__(self, model_dir: Path, redis: RedisServer) -> None:
        self.config = SchedulerConfig(
            port=0, redis_url=redis.url, heartbeat_interval_ms=200, worker_timeout_s=2.0
        )
        self.core = Scheduler(self.config)
        self.server = GrpcServer("scheduler-evict", self.config)
        servicer = SchedulerServicer(self.core)
        self.server.add_service(
            "meshserve.v1.Scheduler", scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer
        )
        self.releases = ReleaseCounter(servicer.router)
        self.model_dir = model_dir
        self.redis = redis

    async def start(self) -> None:
        await self.core.start()
        address = f"127.0.0.1:{await self.server.start()}"
        await self.server.set_serving(True)
        self.channel = grpc.aio.insecure_channel(address)
        self.routes = RouteClient(self.channel)
        self.worker = worker_process(
            self.model_dir, served_model_name="tiny", worker_id=WORKER,
            scheduler_address=address, redis_url=self.redis.url, block_size=BLOCK,
            num_kv_blocks=NUM_BLOCKS, max_num_seqs=2, num_threads=1,
        )  # fmt: skip
        port = await self.worker.start()
        self.worker_channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        while not self.core.index.cursor(WORKER) or self.core.registry.get(WORKER) is None:
            assert time.monotonic() < deadline, "worker did not register / resync"
            await asyncio.sleep(0.05)

    async def generate(self, prompt: list[int]) -> common_pb2.Usage:
        """Route, run on the worker, release with the actual cached tokens (as the gateway)."""
        sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        request = common_pb2.GenerateRequest(model="tiny", prompt_token_ids=prompt, sampling=sampling)
        route = await self.routes.route(request, timeout=30)
        request.lease_id = route.lease_id
        request.request_id = route.request_id
        usage = common_pb2.Usage()
        async for response in generate_one(worker_pb2_grpc.WorkerStub(self.worker_channel), request, 60):
            if response.HasField("usage"):
                usage = response.usage
        outcome = scheduler_pb2.LeaseOutcome(lease_id=route.lease_id, cached_tokens=usage.cached_tokens)
        assert await release_counted(self.routes, self.releases, outcomes=[outcome]) == 1
        return usage

    def cached_hashes(self) -> frozenset[int]:
        """The block manager's cached hashes (read in the worker's own process)."""
        assert self.worker.engine is not None
        return frozenset(self.worker.engine.engine.block_manager._cached)

    async def close(self) -> None:
        await self.worker_channel.close()
        await self.worker.server.server.stop(0)
        await self.worker.close()
        await self.routes.close()
        await self.channel.close()
        await self.server.server.stop(0)
        await self.core.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def stack(tiny_model_dir: Path, redis_server: RedisServer) -> AsyncIterator[Stack]:
    stack = Stack(tiny_model_dir, redis_server)
    await stack.start()
    try:
        yield stack
    finally:
        await stack.close()


async def converged(stack: Stack, timeout: float = 10.0) -> frozenset[int]:
    """Waits until the index's view of the worker equals the block manager's cache."""
    deadline = time.monotonic() + timeout
    while True:
        actual = stack.cached_hashes()
        if stack.core.index.blocks(WORKER) == actual or time.monotonic() > deadline:
            return actual
        await asyncio.sleep(0.05)


@pytest.mark.asyncio(loop_scope="session")
async def test_index_matches_worker_cache_after_evictions(stack: Stack) -> None:
    prompts = [[(p * 131 + i * 7) % 990 + 3 for i in range(72)] for p in range(12)]
    first_blocks = block_hashes(prompts[0], BLOCK)
    for prompt in prompts:
        await stack.generate(prompt)
    actual = await converged(stack)
    # The cache is full of the recent prompts: the first prompt's blocks were evicted.
    assert len(actual) > 0 and not actual & set(first_blocks)
    assert stack.core.index.blocks(WORKER) == actual
    assert not any(stack.core.index.holds(WORKER, b) for b in first_blocks)
    # The subscriber applied events (removals included) instead of only resyncing.
    assert stack.core.index.cursor(WORKER) is not None
    # Routing predicts what the worker then reports: a repeat of the last prompt.
    usage = await stack.generate(prompts[-1])
    assert usage.cached_tokens == (len(prompts[-1]) - 1) // BLOCK * BLOCK
    assert await converged(stack) == stack.core.index.blocks(WORKER)
