"""`stream_interval`: the worker's GenerateStream gathers N tokens of a request per
message after the first, over real gRPC on a real engine; the tokens are the same as with every-token
streaming."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from meshserve.v1 import common_pb2, worker_pb2_grpc
from services.config import from_options
from tests.worker_svc.worker_kit import generate_one, worker_process
from worker_svc.config import WorkerConfig

MAX_TOKENS = 11
PROMPT = [5, 17, 33, 8, 90, 41, 7]


async def _generate(model_dir: Path, interval: int, n: int) -> list[common_pb2.GenerateResponse]:
    worker = worker_process(
        model_dir,
        worker_id=f"w{interval}",
        kv_cache_memory_mb=8,
        stream_interval=interval,
    )
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.server.port}") as channel:
            sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
            request = common_pb2.GenerateRequest(request_id="r", prompt_token_ids=PROMPT, sampling=sampling)
            return [r async for r in generate_one(worker_pb2_grpc.WorkerStub(channel), request, 60)]
    finally:
        await worker.server.server.stop(0)
        await worker.close()


def _tokens(responses: list[common_pb2.GenerateResponse], index: int) -> list[int]:
    return [t for r in responses for d in r.deltas if d.index == index for t in d.token_ids]


@pytest.mark.parametrize("n", [1, 2])
def test_interval_gathers_tokens_without_changing_them(tiny_model_dir: Path, n: int) -> None:
    every = asyncio.run(_generate(tiny_model_dir, 1, n))
    gathered = asyncio.run(_generate(tiny_model_dir, 4, n))
    for index in range(n):
        assert _tokens(gathered, index) == _tokens(every, index)
        assert len(_tokens(gathered, index)) == MAX_TOKENS
    # Message sizes depend on timing: the servicer also merges engine steps that queued
    # up before it woke (with interval 1 too). What the interval guarantees: the first
    # tokens go alone at once, every later message but the last carries >= 4 tokens of
    # each sequence, so at most 1 + ceil(10 / 4) = 4 messages; the end goes at once.
    assert gathered[0].worker_id == "w4" and _tokens(gathered[:1], 0)
    for middle in gathered[1:-1]:
        for index in range(n):
            assert len(_tokens([middle], index)) >= 4, middle
    assert len(gathered) <= 4
    assert gathered[-1].finished and gathered[-1].usage.completion_tokens == n * MAX_TOKENS
    assert not any(r.finished for r in gathered[:-1])


def test_interval_must_be_positive(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        from_options(WorkerConfig, model_dir=str(tiny_model_dir), stream_interval=0)
