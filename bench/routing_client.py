"""routing_bench's client: requests sent the way the gateway sends them (a route on the
scheduler's RouteStream, the request on the routed worker's GenerateStream, the lease's
release with the actual cached tokens), the closed loop's conversations and the open
loop's sessions, and the client's probes of the mesh (workers ready, their queues, a
route's latency)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from bench.routing_metrics import Record, percentile
from bench.routing_workload import BenchConfig, Conversation, OpenLoop
from gateway.route_stream import RouteStream
from meshserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

# The name the mesh serves the model under (launcher config) and every request names.
MODEL_NAME = "bench-model"


async def wait_ready(stub: scheduler_pb2_grpc.SchedulerStub, workers: int, timeout: float = 300) -> list[str]:
    """Addresses of the workers once all of them are registered and healthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.aio.AioRpcError):
            reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
            healthy = [
                s.worker.address
                for s in reply.workers
                if s.healthy and s.worker.role == worker_pb2.WORKER_ROLE_DECODER
            ]
            if len(healthy) >= workers:
                return healthy
        await asyncio.sleep(0.5)
    raise TimeoutError("workers did not register in time")


def _request(prompt: Sequence[int], max_tokens: int, request_id: str) -> common_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return common_pb2.GenerateRequest(
        request_id=request_id, model=MODEL_NAME, prompt_token_ids=list(prompt), sampling=sampling
    )


class Mesh:
    """The client side: a route stream to the scheduler and one channel per worker (as a
    gateway keeps)."""

    def __init__(self, scheduler: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.routes = RouteStream(scheduler, "scheduler")
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def route(self, request: common_pb2.GenerateRequest, timeout: float) -> scheduler_pb2.RouteResponse:
        """A lease for `request` (a refused route raises its grpc.aio.AioRpcError)."""
        message = scheduler_pb2.RouteStreamRequest(route=scheduler_pb2.RouteRequest(request=request))
        return await self.routes.route(message, timeout)

    def release(self, release: scheduler_pb2.ReleaseRequest) -> None:
        """Releases on the route stream (in the background, as the gateway does)."""
        self.routes.release(release)

    def worker(self, address: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return worker_pb2_grpc.WorkerStub(channel)

    async def close(self) -> None:
        await self.routes.close()
        for channel in self._channels.values():
            await channel.close()


async def _generate_one(
    stub: worker_pb2_grpc.WorkerStub, request: common_pb2.GenerateRequest
) -> AsyncIterator[common_pb2.GenerateResponse]:
    """The request alone on a Worker.GenerateStream (half-closed after the add): its
    responses up to the finished one; a RequestError raises."""
    call = stub.GenerateStream(timeout=600)
    try:
        await call.write(worker_pb2.GenerateStreamRequest(add=request))
        await call.done_writing()
        async for message in call:
            for error in message.errors:
                raise RuntimeError(f"request {error.request_id} failed ({error.code}): {error.message}")
            for output in message.outputs:
                yield output
    finally:
        call.cancel()


async def send(
    mesh: Mesh, prompt: Sequence[int], max_tokens: int, request_id: str
) -> tuple[Record, list[int]]:
    """Route, the request on the routed worker's GenerateStream, release; the record and
    the tokens."""
    request = _request(prompt, max_tokens, request_id)
    start = time.perf_counter()
    route = await mesh.route(request, timeout=600)
    routed = time.perf_counter()
    request.lease_id = route.lease_id
    ttft = 0.0
    output: list[int] = []
    last: Any = None
    try:
        async for response in _generate_one(mesh.worker(route.worker_address), request):
            new = [t for delta in response.deltas if delta.index == 0 for t in delta.token_ids]
            if new and not output:
                ttft = time.perf_counter() - start
            output.extend(new)
            last = response
    finally:
        usage = last.usage if last is not None else common_pb2.Usage()
        # The actual cached tokens go back with the lease, as the gateway sends them.
        outcome = scheduler_pb2.LeaseOutcome(
            lease_id=route.lease_id, cached_tokens=usage.cached_tokens, prompt_tokens=usage.prompt_tokens
        )
        mesh.release(scheduler_pb2.ReleaseRequest(outcomes=[outcome]))
    latency = time.perf_counter() - start
    record = Record(ttft, latency, usage.prompt_tokens, usage.cached_tokens, len(output),
                    routed - start, route.worker_id, start, tuple(prompt), tuple(output),
                    route.predicted_cached_tokens)  # fmt: skip
    return record, output


async def run_conversation(
    mesh: Mesh, conv: Conversation, index: int, config: BenchConfig,
    gate: asyncio.Semaphore, records: list[Record],
) -> None:  # fmt: skip
    """One closed-loop conversation: turn after turn on the growing history, each request
    holding a slot of `gate` (the concurrency)."""
    history = list(conv.system)
    for turn, user in enumerate(conv.turns):
        history.extend(user)
        async with gate:
            record, output = await send(mesh, history, config.max_tokens, f"c{index}-t{turn}")
        records.append(record)
        history.extend(output)


async def run_session(
    mesh: Mesh, conv: Conversation, index: int, config: BenchConfig, loop: OpenLoop,
    records: list[Record],
) -> None:  # fmt: skip
    """One open-loop session: starts at its arrival time, then turn after turn."""
    await asyncio.sleep(max(0.0, loop.start + loop.arrivals[index] - time.perf_counter()))
    loop.live_sessions += 1
    history = list(conv.system)
    try:
        for turn, user in enumerate(conv.turns):
            if loop.think[index][turn] > 0:
                await asyncio.sleep(loop.think[index][turn])
            history.extend(user)
            loop.in_flight += 1
            try:
                record, output = await send(mesh, history, config.max_tokens, f"s{index}-t{turn}")
            except grpc.aio.AioRpcError:
                # Rejected or timed out (overload): the user gives up, the session ends.
                loop.failed += 1
                return
            finally:
                loop.in_flight -= 1
            records.append(record)
            history.extend(output)
    finally:
        loop.live_sessions -= 1


async def warm_up(mesh: Mesh, config: BenchConfig) -> None:
    """A few unrelated requests so every worker has run its first (slow) steps."""
    rng = random.Random(-1)
    prompts = [[rng.randrange(3, config.vocab) for _ in range(48)] for _ in range(2 * config.workers)]
    await asyncio.gather(*(send(mesh, p, 4, f"warmup-{i}") for i, p in enumerate(prompts)))


async def sample_queues(
    stub: scheduler_pb2_grpc.SchedulerStub, samples: dict[str, list[int]], interval_s: float = 0.1,
    loop: OpenLoop | None = None, timeline: list[dict[str, Any]] | None = None,
    every_s: float = 0.5,
) -> None:  # fmt: skip
    """Every `interval_s`, each worker's queue (running + waiting, from its heartbeats);
    with `loop`, every `every_s` a timeline row: those queues, the requests the client
    has in flight and the live sessions."""
    next_row = 0.0
    while True:
        queues: dict[str, int] = {}
        with contextlib.suppress(grpc.aio.AioRpcError):
            reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=2)
            for status in reply.workers:
                queue = queues[status.worker.worker_id] = status.load.num_running + status.load.num_waiting
                samples.setdefault(status.worker.worker_id, []).append(queue)
        now = time.perf_counter() - loop.start if loop is not None else 0.0
        if loop is not None and timeline is not None and now >= next_row:
            next_row = now + every_s
            timeline.append({"t": round(now, 2), "worker_queue": queues,
                             "client_in_flight": loop.in_flight, "live_sessions": loop.live_sessions})  # fmt: skip
        await asyncio.sleep(interval_s)


async def probe_route(mesh: Mesh, records: list[Record], count: int) -> dict[str, float]:
    """Route + release back to back on the run's prompts (warm index, idle workers): the
    client-side cost of a route without admission queueing."""
    latencies = []
    for i in range(count):
        prompt = records[i % len(records)].prompt
        request = _request(prompt, 1, f"probe-{i}")
        start = time.perf_counter()
        route = await mesh.route(request, timeout=30)
        latencies.append((time.perf_counter() - start) * 1000)
        mesh.release(scheduler_pb2.ReleaseRequest(lease_ids=[route.lease_id]))
    return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99), "count": count}
