"""Mid-stream migration, the worker's half: a request that arrives with the output it
already produced elsewhere (`GenerateRequest.resumed`) goes on exactly where an
uninterrupted run would -- greedy and seeded, n=2 with one choice already finished --
through the real `Worker.GenerateStream` on loopback with a real (tiny) model. Also: bad
`resumed` fields are INVALID_ARGUMENT naming the field, and no KV block stays in use.
"""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

from meshserve.v1 import common_pb2, worker_pb2_grpc
from tests.worker_svc.worker_kit import RequestFailed, Tokens, generate_tokens, run_worker

MAX_TOKENS = 24
PROMPT = [random.Random(7).randrange(1, 1000) for _ in range(19)]
CUT = 9  # tokens generated before the "migration"


def _sampling(greedy: bool, n: int = 1) -> common_pb2.SamplingParams:
    if greedy:
        return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
    return common_pb2.SamplingParams(
        temperature=1.0, top_k=50, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True, n=n
    )


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_resumed_request_continues_like_an_uninterrupted_run(tiny_model_dir: Path, greedy: bool) -> None:
    async def body(stub: worker_pb2_grpc.WorkerStub) -> tuple[Tokens, Tokens]:
        whole = await generate_tokens(
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
        return whole, await generate_tokens(stub, resumed)

    (whole, rest), load = run_worker(tiny_model_dir, body)
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
    async def body(stub: worker_pb2_grpc.WorkerStub) -> RequestFailed:
        request = common_pb2.GenerateRequest(
            request_id="bad", prompt_token_ids=PROMPT, sampling=_sampling(True), resumed=resumed
        )
        with pytest.raises(RequestFailed) as caught:
            await generate_tokens(stub, request)
        return caught.value

    error, load = run_worker(tiny_model_dir, body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "resumed" in (error.details() or ""), error.details()
    assert load.num_free_blocks == load.num_total_blocks
