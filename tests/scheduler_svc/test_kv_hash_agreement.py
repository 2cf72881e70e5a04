"""The scheduler's block hashes of a request equal those a real worker's engine publishes
for it: a real decoder worker (tiny model, in-process) behind a real scheduler and a real
Redis. The request is routed, run on the chosen worker's Worker.GenerateStream, and the
worker's published block set is compared with what `routing_request` hashes -- for a
plain request and a salted one (the multimodal case is in
tests/multimodal/test_mm_kv_hash_agreement.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis

from meshserve.v1 import common_pb2, worker_pb2_grpc
from scheduler_svc.route import routing_request
from services.kv_contract import index_key
from services.kv_hash import block_hashes
from services.redis_client import RedisServer
from tests.scheduler_svc.conftest import RunningScheduler, SchedulerFactory
from tests.worker_svc.worker_kit import generate_one, worker_process
from worker_svc.main import WorkerProcess

pytestmark = pytest.mark.timeout(120)

BLOCK = 4
MODEL = "tiny"
WORKER = "hash-w"


@pytest.fixture
async def mesh(
    start_scheduler: SchedulerFactory, tiny_model_dir: Path, redis_server: RedisServer
) -> AsyncIterator[tuple[RunningScheduler, WorkerProcess]]:
    redis.Redis.from_url(redis_server.url).delete(index_key(WORKER))
    sched = await start_scheduler(redis_url=redis_server.url, speculative_ttl_s=0, block_size=BLOCK)
    worker = worker_process(
        tiny_model_dir, served_model_name=MODEL, worker_id=WORKER,
        scheduler_address=sched.address, redis_url=redis_server.url, block_size=BLOCK,
        kv_cache_memory_mb=8, num_threads=1,
    )  # fmt: skip
    await worker.start()
    try:
        await sched.wait_for(lambda: sched.core.registry.get(WORKER) is not None, timeout=20)
        await sched.wait_for(lambda: sched.core.subscriber is not None and sched.core.subscriber.connected)
        yield sched, worker
    finally:
        await worker.server.server.stop(0)
        await worker.close()


async def run_routed(
    sched: RunningScheduler, request: common_pb2.GenerateRequest, model: str = MODEL
) -> common_pb2.Usage:
    """Route, the request on the chosen (real) worker, Release -- the gateway's path."""
    route = await sched.route(list(request.prompt_token_ids), model=model, cache_salt=request.cache_salt)
    assert route.worker_id == WORKER
    request.request_id, request.lease_id = route.request_id, route.lease_id
    try:
        async with grpc.aio.insecure_channel(route.worker_address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            responses = [r async for r in generate_one(stub, request, timeout=60)]
    finally:
        await sched.release(route.lease_id)
    assert responses[-1].finished
    return responses[-1].usage


def published(redis_url: str) -> set[int]:
    return {int(h) for h in redis.Redis.from_url(redis_url).smembers(index_key(WORKER))}


async def test_scheduler_and_engine_hash_requests_alike(
    mesh: tuple[RunningScheduler, WorkerProcess], redis_server: RedisServer
) -> None:
    sched, worker = mesh
    assert worker.publisher is not None
    prompt = [(11 * i) % 200 + 3 for i in range(7 * BLOCK + 1)]  # 7 full blocks + 1 token
    sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    expected: set[int] = set()
    for salt in ("", "tenant-a"):
        request = common_pb2.GenerateRequest(
            model=MODEL, prompt_token_ids=prompt, sampling=sampling, cache_salt=salt
        )
        hashes = block_hashes(prompt, BLOCK, routing_request(request).extra_keys)
        assert len(hashes) == 7 and not expected & set(hashes)  # a salt changes every block
        usage = await run_routed(sched, request)
        assert usage.cached_tokens == 0
        expected |= set(hashes)
        await asyncio.to_thread(worker.publisher.wait_idle)
        # What the engine published is exactly what the scheduler hashes.
        assert published(redis_server.url) == expected
        # ... so the scheduler's index (fed by those events) finds the prefix there.
        await sched.wait_for(lambda h=hashes: sched.core.index.holds(WORKER, h[-1]))
        reply = await sched.route(prompt, model=MODEL, cache_salt=salt)
        assert reply.reason == "prefix" and reply.predicted_cached_tokens == 7 * BLOCK
        await sched.release(reply.lease_id)
    # Run again: the worker serves the predicted prefix from its cache.
    again = common_pb2.GenerateRequest(
        model=MODEL, prompt_token_ids=prompt, sampling=sampling, cache_salt="tenant-a"
    )
    assert (await run_routed(sched, again)).cached_tokens == 7 * BLOCK
