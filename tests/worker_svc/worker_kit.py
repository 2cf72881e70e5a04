"""A real worker process on loopback for tests that talk to it over gRPC: start it, run a
body against its stub, and read its load (in-process, as its heartbeats report it) once
the engine's stats have settled; and one
request on a `Worker.GenerateStream` of its own (`generate_one`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.config import from_options
from worker_svc.config import WorkerConfig
from worker_svc.decoder_servicer import load_stats
from worker_svc.main import WorkerProcess

T = TypeVar("T")
Tokens = dict[int, list[int]]  # sample index -> generated token ids


class RequestFailed(Exception):
    """The request's `RequestError` on its GenerateStream, read as a failed call's status:
    `code()`, `details()`, and the field at fault (`param`)."""

    def __init__(self, error: worker_pb2.RequestError) -> None:
        self.error = error
        self.param = error.param
        super().__init__(f"{self.code().name}: {error.message}")

    def code(self) -> grpc.StatusCode:
        return next(code for code in grpc.StatusCode if code.value[0] == self.error.code)

    def details(self) -> str:
        return self.error.message


async def generate_one(
    stub: worker_pb2_grpc.WorkerStub, request: common_pb2.GenerateRequest, timeout: float = 120
) -> AsyncIterator[common_pb2.GenerateResponse]:
    """`request` alone on a GenerateStream, half-closed after the add: its responses up
    to the finished one. Its RequestError raises RequestFailed, a failed call
    AioRpcError; leaving early cancels the call, which aborts the request."""
    call = stub.GenerateStream(timeout=timeout)
    try:
        await call.write(worker_pb2.GenerateStreamRequest(add=request))
        await call.done_writing()
        async for message in call:
            for error in message.errors:
                raise RequestFailed(error)
            for output in message.outputs:
                yield output
    finally:
        call.cancel()


async def generate_tokens(
    stub: worker_pb2_grpc.WorkerStub, request: common_pb2.GenerateRequest, timeout: float = 120
) -> Tokens:
    """Every token each sample produced (`generate_one`)."""
    tokens: Tokens = {}
    async for reply in generate_one(stub, request, timeout):
        for delta in reply.deltas:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
    return tokens


async def settled_load(worker: WorkerProcess, timeout: float = 10.0) -> worker_pb2.LoadStats:
    """The worker's load (as its heartbeats report it) once nothing runs or waits and every
    block is free, or after `timeout`: the engine refreshes its stats after its last step,
    so a read right after the last output may still count the request running (a block
    still held then is a leak)."""
    assert worker.engine is not None, "not a decoder or prefill worker"
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        load = load_stats(worker.engine)
        idle = load.num_running == 0 and load.num_waiting == 0
        if (
            idle and load.num_free_blocks == load.num_total_blocks
        ) or asyncio.get_running_loop().time() > deadline:
            return load
        await asyncio.sleep(0.05)


def worker_process(model_dir: Path | str, **options: Any) -> WorkerProcess:
    """An in-process worker on a free port (not started), `options` as WorkerConfig fields.
    Eager, like every worker the tests start (tests/conftest.py): a compiled forward would
    cost each one a warm-up; the compiled path has tests of its own."""
    return WorkerProcess(
        from_options(WorkerConfig, compile_model=False, port=0, model_dir=str(model_dir), **options)
    )


def run_worker(
    model_dir: Path, body: Callable[[worker_pb2_grpc.WorkerStub], Awaitable[T]], **config: Any
) -> tuple[T, worker_pb2.LoadStats]:
    """Starts a worker (block size 4, 8 MB of KV unless `config` says otherwise), runs
    `body(stub)`, and returns its result with the settled load; the worker is stopped."""

    async def main() -> tuple[T, worker_pb2.LoadStats]:
        options = {"worker_id": "w", "block_size": 4, "kv_cache_memory_mb": 8, **config}
        worker = worker_process(model_dir, **options)
        await worker.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.server.port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                result = await body(stub)
                return result, await settled_load(worker)
        finally:
            await worker.server.server.stop(0)
            await worker.close()

    return asyncio.run(main())
