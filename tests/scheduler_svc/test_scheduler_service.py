"""Scheduler over real gRPC with fake workers: registry RPCs, routing, failover,
cancellation, Abort, overflow, draining, Embed (no Redis)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from meshserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.servicer import OVERHEAD_METADATA_KEY
from services.redis_client import free_port
from services.rpc import check_health

pytestmark = pytest.mark.timeout(60)


async def read_rest(call: Any) -> list[common_pb2.GenerateResponse]:
    """The remaining messages of a call consumed with read() (iteration cannot follow read)."""
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    return rest


def tokens(responses: list[common_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for d in r.deltas for t in d.token_ids]


async def test_generate_streams_worker_tokens(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    await start_worker("w1", sched, tokens=3)
    call = sched.stub.Generate(
        common_pb2.GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3])
    )
    responses = [r async for r in call]
    assert tokens(responses) == [6, 7, 8]
    assert responses[-1].finished and responses[-1].usage.completion_tokens == 3
    assert all(r.worker_id == "w1" for r in responses)
    trailing = dict(await call.trailing_metadata())
    assert 0 <= int(trailing[OVERHEAD_METADATA_KEY]) < 1_000_000
    assert sched.core.registry.get("w1").inflight == 0


async def test_registry_rpcs(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    reply = await sched.stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="ghost"))
    assert not reply.known
    worker = await start_worker("w1", sched)
    await start_worker("e1", sched, model="emb", role="embedding")
    listing = await sched.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
    assert {s.worker.worker_id for s in listing.workers} == {"w1", "e1"}
    assert list(listing.models) == ["emb", "m"]
    assert all(s.healthy and not s.draining for s in listing.workers)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        bad = scheduler_pb2.WorkerDescriptor(
            worker_id="x", address="a:1", role="oops", model="m", block_size=4
        )
        await sched.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A silent worker is marked unhealthy and leaves the model list.
    worker.heartbeating = False
    await sched.wait_for(lambda: not sched.core.registry.get("w1").healthy)
    listing = await sched.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
    status = next(s for s in listing.workers if s.worker.worker_id == "w1")
    assert not status.healthy and status.last_heartbeat_age_s > 0.5
    assert list(listing.models) == ["emb"]
    worker.heartbeating = True
    await sched.wait_for(lambda: sched.core.registry.get("w1").healthy)


async def test_unknown_model_and_no_workers(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.generate([1, 2])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    await start_worker("w1", sched)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.generate([1, 2], model="other")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model 'other'" in (info.value.details() or "")


async def test_failover_before_first_token(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(routing_policy="round_robin")
    broken = await start_worker("a", sched)
    healthy = await start_worker("b", sched)
    broken.fail_first = True
    responses = await sched.generate([5, 5], request_id="r-fail")
    assert tokens(responses) == [10, 11, 12, 13]
    assert responses[0].worker_id == "b"
    assert broken.started == ["r-fail"] and healthy.started == ["r-fail"]
    # The failed worker is suspect: new requests avoid it while it lasts.
    for _ in range(3):
        assert (await sched.generate([1]))[0].worker_id == "b"


async def test_failover_gives_up_after_max_retries(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(max_retries=1)
    for name in ("a", "b", "c"):
        (await start_worker(name, sched)).fail_first = True
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.generate([1])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "gave up after 2 attempts" in (info.value.details() or "")


async def test_worker_death_after_tokens_ends_stream_with_unavailable(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched = await start_scheduler()
    worker = await start_worker("a", sched, tokens=10)
    worker.die_after = 2
    received: list[common_pb2.GenerateResponse] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in sched.stub.Generate(
            common_pb2.GenerateRequest(model="m", prompt_token_ids=[1])
        ):
            received.append(response)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker a failed after 2 tokens" in (info.value.details() or "")
    assert len(tokens(received)) == 2


async def test_hung_worker_is_detected_by_heartbeat_timeout(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    worker = await start_worker("a", sched, tokens=10)
    worker.hang_after = 1
    start = asyncio.get_running_loop().time()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.generate([1])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker a failed after 1 tokens" in (info.value.details() or "")
    assert asyncio.get_running_loop().time() - start < 5


async def test_client_cancellation_cancels_worker_call(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    worker = await start_worker("a", sched, tokens=1000, delay=0.02)
    call = sched.stub.Generate(common_pb2.GenerateRequest(request_id="c1", model="m", prompt_token_ids=[1]))
    async for _ in call:
        break
    call.cancel()
    await sched.wait_for(lambda: worker.cancelled == ["c1"])
    await sched.wait_for(lambda: sched.core.registry.get("a").inflight == 0 and not sched.core.running)


async def test_abort_is_forwarded_to_the_worker(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    worker = await start_worker("a", sched, tokens=1000, delay=0.02)
    call = sched.stub.Generate(common_pb2.GenerateRequest(request_id="ab1", model="m", prompt_token_ids=[1]))
    first = await call.read()
    assert first.worker_id == "a"
    reply = await sched.stub.Abort(common_pb2.AbortRequest(request_id="ab1"))
    assert reply.found and worker.aborted == ["ab1"]
    rest = await read_rest(call)
    assert rest[-1].finished and rest[-1].deltas[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not (await sched.stub.Abort(common_pb2.AbortRequest(request_id="nope"))).found


async def test_queue_overflow_and_abort_while_queued(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(max_inflight_per_worker=1, max_queue_len=1)
    await start_worker("a", sched, tokens=1000, delay=0.01)
    running = sched.stub.Generate(
        common_pb2.GenerateRequest(request_id="run", model="m", prompt_token_ids=[1])
    )
    await running.read()
    queued = sched.stub.Generate(common_pb2.GenerateRequest(request_id="q", model="m", prompt_token_ids=[2]))
    await sched.wait_for(lambda: len(sched.core.dispatcher.queue) == 1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.generate([3])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in (info.value.details() or "")
    assert (await sched.stub.Abort(common_pb2.AbortRequest(request_id="q"))).found
    final = [r async for r in queued]
    assert final[-1].finished and final[-1].deltas[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    running.cancel()


async def test_queued_requests_run_when_capacity_frees(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(max_inflight_per_worker=1, max_queue_len=16)
    worker = await start_worker("a", sched, tokens=3, delay=0.005)
    results = await asyncio.gather(*(sched.generate([i]) for i in range(6)))
    assert all(r[-1].finished for r in results)
    assert len(worker.started) == 6


async def test_draining_worker_gets_no_new_requests(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(routing_policy="round_robin")
    draining = await start_worker("a", sched)
    await start_worker("b", sched)
    draining.draining = True
    await sched.wait_for(lambda: sched.core.registry.get("a").draining)
    for _ in range(4):
        assert (await sched.generate([1]))[0].worker_id == "b"
    assert draining.started == []


async def test_embed_routing(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler()
    await start_worker("d1", sched)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.stub.Embed(common_pb2.EmbedRequest(model="m", inputs=["x"]))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no embedding worker at all
    broken = await start_worker("e1", sched, model="emb", role="embedding")
    await start_worker("e2", sched, model="emb", role="embedding")
    broken.fail_first = True
    reply = await sched.stub.Embed(common_pb2.EmbedRequest(model="emb", inputs=["ab", "abc"]))
    assert [list(e.values) for e in reply.embeddings] == [[2.0, 1.0], [3.0, 1.0]]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.stub.Embed(common_pb2.EmbedRequest(model="nope", inputs=["x"]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_worker_gauges_follow_health(start_scheduler: Any, start_worker: Any) -> None:
    def gauge(health: str) -> float:
        value = REGISTRY.get_sample_value(
            "meshserve_scheduler_workers", {"role": "decoder", "health": health}
        )
        return value or 0.0

    sched = await start_scheduler()
    worker = await start_worker("g1", sched)
    await sched.wait_for(lambda: gauge("healthy") == 1)
    worker.heartbeating = False
    await sched.wait_for(lambda: gauge("unhealthy") == 1 and gauge("healthy") == 0)


async def test_process_entry_point_serves_and_drains() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler_svc", "--port", str(port), "--routing-policy", "least_load",
        env={**os.environ, "MESHSERVE_DRAIN_TIMEOUT_S": "1"},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while not await check_health(f"127.0.0.1:{port}", "meshserve.v1.Scheduler"):
            assert proc.returncode is None, "scheduler exited"
            assert asyncio.get_running_loop().time() < deadline, "scheduler did not become healthy"
            await asyncio.sleep(0.1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            descriptor = scheduler_pb2.WorkerDescriptor(
                worker_id="p1", address="127.0.0.1:1", model="m", block_size=16, max_num_seqs=2
            )
            reply = await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=descriptor))
            assert reply.heartbeat_interval_ms == 500
            listing = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
            assert [s.worker.worker_id for s in listing.workers] == ["p1"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
