"""Mid-stream migration, the worker's half: a request that arrives with the output it
already produced elsewhere (`GenerateRequest.resumed`) goes on exactly where an
uninterrupted run would -- greedy and seeded, n=2 with one choice already finished --
through the real `Worker.Generate` on loopback with a real (tiny) model. Also: bad
`resumed` fields are INVALID_ARGUMENT naming the field, and no KV block stays in use.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_svc.config import WorkerConfig
from worker_svc.main import WorkerProcess

MAX_TOKENS = 24
PROMPT = [random.Random(7).randrange(1, 1000) for _ in range(19)]
CUT = 9  # tokens generated before the "migration"

Tokens = dict[int, list[int]]


def _sampling(greedy: bool, n: int = 1) -> common_pb2.SamplingParams:
    if greedy:
        return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
    return common_pb2.SamplingParams(
        temperature=1.0, top_k=50, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True, n=n
    )


async def _generate(stub: worker_pb2_grpc.WorkerStub, request: common_pb2.GenerateRequest) -> Tokens:
    tokens: Tokens = {}
    async for reply in stub.Generate(request, timeout=60):
        for delta in reply.deltas:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
    return tokens


async def _with_worker(model_dir: Path, body):  # type: ignore[no-untyped-def]
    worker = WorkerProcess(
        WorkerConfig(port=0, model_dir=str(model_dir), worker_id="w", block_size=4, kv_cache_memory_mb=8)
    )
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.server.port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            result = await body(stub)
            return result, await _settled_load(stub)
    finally:
        await worker.server.server.stop(0)
        await worker.close()


async def _settled_load(stub: worker_pb2_grpc.WorkerStub, timeout: float = 10.0) -> worker_pb2.LoadStats:
    """GetLoad once nothing runs (the engine refreshes its stats after its last step, so
    a reply right after the last output may still count the request running)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        if (load.num_running == 0 and load.num_waiting == 0) or asyncio.get_running_loop().time() > deadline:
            return load
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_resumed_request_continues_like_an_uninterrupted_run(tiny_model_dir: Path, greedy: bool) -> None:
    async def body(stub: worker_pb2_grpc.WorkerStub) -> tuple[Tokens, Tokens]:
        whole = await _generate(
            stub,
            common_pb2.GenerateRequest(
                request_id="whole", prompt_token_ids=PROMPT, sampling=_sampling(greedy, 2)
            ),
        )
        # Choice 0 moved after CUT tokens; choice 1 had already ended (not run again).
        resumed = common_pb2.GenerateRequest(
            request_id="moved",
            prompt_token_ids=PROMPT,
            sampling=_sampling(greedy, 2),
            resumed=[
                common_pb2.ResumedOutput(index=0, token_ids=whole[0][:CUT]),
                common_pb2.ResumedOutput(index=1, token_ids=whole[1], finished=True),
            ],
        )
        return whole, await _generate(stub, resumed)

    (whole, rest), load = asyncio.run(_with_worker(tiny_model_dir, body))
    assert len(whole[0]) == MAX_TOKENS
    assert set(rest) == {0}, "a finished choice must not run again"
    assert whole[0][:CUT] + rest[0] == whole[0]
    if not greedy:
        assert whole[0] != whole[1]  # really sampled
    assert load.num_free_blocks == load.num_total_blocks


@pytest.mark.parametrize(
    "resumed",
    [
        [common_pb2.ResumedOutput(index=3, token_ids=[5])],
        [common_pb2.ResumedOutput(index=0, token_ids=[5]), common_pb2.ResumedOutput(index=0, token_ids=[6])],
        [common_pb2.ResumedOutput(index=0, token_ids=[5], finished=True)],
        [common_pb2.ResumedOutput(index=0, token_ids=[10**9])],
        [common_pb2.ResumedOutput(index=0, token_ids=[5] * MAX_TOKENS)],
    ],
    ids=["index-out-of-range", "index-repeated", "all-finished", "token-outside-vocab", "no-budget-left"],
)
def test_bad_resumed_is_invalid_argument(
    tiny_model_dir: Path, resumed: list[common_pb2.ResumedOutput]
) -> None:
    async def body(stub: worker_pb2_grpc.WorkerStub) -> grpc.aio.AioRpcError:
        request = common_pb2.GenerateRequest(
            request_id="bad", prompt_token_ids=PROMPT, sampling=_sampling(True), resumed=resumed
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _generate(stub, request)
        return caught.value

    error, load = asyncio.run(_with_worker(tiny_model_dir, body))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "resumed" in (error.details() or ""), error.details()
    assert load.num_free_blocks == load.num_total_blocks
