"""LoRA in the scheduler: adapters a worker reports are served models, requests for an
adapter prefer workers where it is resident unless that worker is much busier, and (real
worker, scheduler and Redis) the scheduler hashes an adapter request's blocks exactly as
the worker publishes them -- keyed by the adapter, so they share nothing with the base
model's blocks of the same prompt."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from meshserve.v1 import common_pb2
from scheduler_svc.policies import PrefixAwarePolicy, RoutingRequest
from scheduler_svc.prefix_index import PrefixIndex
from scheduler_svc.registry import LoadSnapshot, WorkerRegistry, WorkerSpec, WorkerState
from scheduler_svc.route import routing_request
from services.kv_contract import index_key
from services.kv_hash import block_hashes
from services.redis_client import RedisServer
from tests.lora_kit import build_adapters
from tests.scheduler_svc.conftest import RunningScheduler, SchedulerFactory
from tests.scheduler_svc.test_kv_hash_agreement import MODEL, WORKER, published, run_routed
from tests.worker_svc.worker_kit import worker_process
from worker_svc.main import WorkerProcess

BLOCK = 4


def _worker(worker_id: str, running: int, resident: tuple[str, ...]) -> WorkerState:
    state = WorkerState(WorkerSpec(worker_id, "addr", "decoder", "base", 512, BLOCK, 100, 10))
    state.capacity = 10
    state.load = LoadSnapshot(num_running=running, lora_loaded=("a", "b"), lora_resident=resident)
    state.external_load = running
    return state


def test_adapter_residency_weighed_against_load() -> None:
    policy = PrefixAwarePolicy(PrefixIndex(speculative_ttl_s=0))
    req = RoutingRequest("r", "a", [1, 2, 3], adapter="a")
    hot, cold = _worker("w0", 2, ("a",)), _worker("w1", 0, ("b",))
    assert policy.choose(req, [hot, cold]).worker is hot  # resident beats a 2-request lead
    assert policy.choose(RoutingRequest("r", "base", [1, 2, 3]), [hot, cold]).worker is cold
    busy = _worker("w0", 6, ("a",))
    assert policy.choose(req, [busy, cold]).worker is cold  # too busy: a second worker loads it


def test_a_cold_adapter_goes_where_a_slot_is_free() -> None:
    policy = PrefixAwarePolicy(PrefixIndex(speculative_ttl_s=0))
    full, free = _worker("w0", 2, ("a", "b")), _worker("w1", 3, ("b",))
    for state in (full, free):
        state.load = dataclasses.replace(state.load, lora_slots=2)
    # No worker holds "c": the one with a free slot evicts nothing, despite one more request.
    assert policy.choose(RoutingRequest("r", "c", [1, 2, 3], adapter="c"), [full, free]).worker is free


def test_an_adapter_with_requests_in_flight_counts_as_resident_until_they_end() -> None:
    """Routed to a worker whose heartbeat does not list it resident (yet): while requests
    of ours for it run or wait there, later ones follow them (one load serves them all);
    once the last is released, routing goes by the workers' reports again."""
    registry = WorkerRegistry(timeout_s=5, forget_s=60)
    policy = PrefixAwarePolicy(PrefixIndex(speculative_ttl_s=0))
    req = RoutingRequest("r", "a", [1, 2, 3], adapter="a")
    holding, idle = _worker("w0", 2, ()), _worker("w1", 0, ())
    leases = [registry.acquire(holding, "a"), registry.acquire(holding, "a")]
    holding.external_load = 0  # the two requests of ours are its whole load
    assert policy.choose(req, [holding, idle]).worker is holding  # beats a 2-request lead
    assert policy.choose(RoutingRequest("r", "b", [1, 2, 3], adapter="b"), [holding, idle]).worker is idle
    registry.release(leases[0])
    assert policy.choose(req, [holding, idle]).worker is holding
    registry.release(leases[1])
    assert holding.adapter_inflight == {} and holding.inflight == 0
    holding.external_load = 1  # another replica's request: no affinity left to outweigh it
    assert policy.choose(req, [holding, idle]).worker is idle


def test_adapters_are_served_models() -> None:
    registry = WorkerRegistry(timeout_s=5, forget_s=60)
    registry.register(WorkerSpec("w0", "addr", "decoder", "base", 512, BLOCK, 100, 4))
    registry.heartbeat("w0", LoadSnapshot(lora_loaded=("a",)), draining=False)
    assert registry.models() == ["a", "base"]
    assert registry.is_adapter("a") and not registry.is_adapter("base")
    assert [w.worker_id for w in registry.candidates("a", "decoder")] == ["w0"]
    assert registry.candidates("b", "decoder") == []


@pytest.fixture
async def lora_mesh(
    start_scheduler: SchedulerFactory, tiny_model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[tuple[RunningScheduler, WorkerProcess]]:
    adapter = build_adapters(tiny_model_dir, tmp_path, ["ad-all"])["ad-all"]
    redis.Redis.from_url(redis_server.url).delete(index_key(WORKER))
    sched = await start_scheduler(redis_url=redis_server.url, speculative_ttl_s=0, block_size=BLOCK)
    worker = worker_process(
        tiny_model_dir, served_model_name=MODEL, worker_id=WORKER,
        scheduler_address=sched.address, redis_url=redis_server.url, block_size=BLOCK,
        kv_cache_memory_mb=8, num_threads=1, max_loras=1, lora_modules=(f"ad={adapter}",),
    )  # fmt: skip
    await worker.start()
    try:
        await sched.wait_for(lambda: sched.core.registry.is_adapter("ad"), timeout=20)
        await sched.wait_for(lambda: sched.core.subscriber is not None and sched.core.subscriber.connected)
        yield sched, worker
    finally:
        await worker.server.server.stop(0)
        await worker.close()


@pytest.mark.timeout(180)
async def test_adapter_blocks_hashed_alike_and_apart_from_the_base(
    lora_mesh: tuple[RunningScheduler, WorkerProcess], redis_server: RedisServer
) -> None:
    sched, worker = lora_mesh
    assert worker.publisher is not None
    prompt = [(7 * i) % 200 + 3 for i in range(5 * BLOCK + 1)]
    sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    expected: set[int] = set()
    for model in (MODEL, "ad"):
        request = common_pb2.GenerateRequest(model=model, prompt_token_ids=prompt, sampling=sampling)
        adapter = sched.core.registry.is_adapter(model)
        hashes = block_hashes(prompt, BLOCK, routing_request(request, adapter).extra_keys)
        assert len(hashes) == 5 and not expected & set(hashes)  # the adapter changes every block
        usage = await run_routed(sched, request, model=model)
        assert usage.cached_tokens == 0  # the base model's blocks were not reused
        expected |= set(hashes)
        await asyncio.to_thread(worker.publisher.wait_idle)
        assert published(redis_server.url) == expected
