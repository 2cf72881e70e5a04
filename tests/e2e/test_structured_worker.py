"""Structured outputs at the worker, through the real `Worker.GenerateStream` on loopback with the
real tiny model and its tokenizer: constrained seeded requests preempted (recompute) on a
small KV cache produce exactly what they produce alone (the matcher never advances twice)
and stay valid; a migrated constrained request continues like an uninterrupted one (its
resumed tokens replayed into a fresh matcher); a bad constraint is INVALID_ARGUMENT
naming the field and the worker goes on -- refused up front, or when the matcher fails to
build on the worker (a RequestError on the GenerateStream, not an "abort" finish); no KV
block stays in use."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.worker_svc.worker_kit import RequestFailed, Tokens, generate_tokens, run_worker

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
            "note": {"type": "string", "maxLength": 12},
        },
        "required": ["id", "tags", "note"],
        "additionalProperties": False,
    }
)
PROMPTS = [[(7 * i + 13 * j) % 900 + 20 for j in range(10 + 3 * i)] for i in range(5)]


def _sampling(seed: int, n: int = 1) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=1.0, seed=seed, max_tokens=80, n=n, structured_kind="json", structured_spec=SCHEMA
    )


def _all(stub: worker_pb2_grpc.WorkerStub):  # type: ignore[no-untyped-def]
    requests = [
        common_pb2.GenerateRequest(
            request_id=f"r{i}", prompt_token_ids=p, sampling=_sampling(10 + i, 2 if i == 4 else 1)
        )
        for i, p in enumerate(PROMPTS)
    ]
    return asyncio.gather(*(generate_tokens(stub, r) for r in requests))


def test_preempted_constrained_requests_match_solo_runs_and_parse(model_dir: Path) -> None:
    roomy, _ = run_worker(model_dir, _all, enable_prefix_caching=False)
    # 30 blocks of 4 tokens: five requests (six sequences) of up to 22 + 80 tokens cannot all fit.
    tight, load = run_worker(model_dir, _all, num_kv_blocks=30, enable_prefix_caching=False)
    assert load.num_preemptions > 0
    assert tight == roomy
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for tokens in roomy:
        for ids in tokens.values():
            value = json.loads(tokenizer.decode(ids, skip_special_tokens=True))
            assert set(value) == {"id", "tags", "note"}
    assert load.num_free_blocks == load.num_total_blocks


def test_migrated_constrained_request_continues_from_its_tokens(model_dir: Path) -> None:
    async def body(stub: worker_pb2_grpc.WorkerStub) -> tuple[Tokens, Tokens]:
        whole = await generate_tokens(
            stub,
            common_pb2.GenerateRequest(
                request_id="whole", prompt_token_ids=PROMPTS[0], sampling=_sampling(3)
            ),
        )
        moved = common_pb2.GenerateRequest(
            request_id="moved",
            prompt_token_ids=PROMPTS[0],
            sampling=_sampling(3),
            resumed=[common_pb2.ResumedOutput(index=0, token_ids=whole[0][:6])],
        )
        return whole, await generate_tokens(stub, moved)

    (whole, rest), load = run_worker(model_dir, body, enable_prefix_caching=False)
    assert len(whole[0]) > 6
    assert whole[0][:6] + rest[0] == whole[0]
    assert load.num_free_blocks == load.num_total_blocks


@pytest.mark.parametrize(
    ("kind", "spec", "field"),
    [
        ("json", '{"type": "bogus"}', "structured_outputs"),
        ("regex", "a(", "structured_outputs"),
        ("xml", "", "structured_outputs"),
        ("json", "{}", "logit_bias"),
    ],
)
def test_bad_constraint_is_invalid_argument(model_dir: Path, kind: str, spec: str, field: str) -> None:
    async def body(stub: worker_pb2_grpc.WorkerStub):  # type: ignore[no-untyped-def]
        sampling = common_pb2.SamplingParams(max_tokens=8, structured_kind=kind, structured_spec=spec)
        if field == "logit_bias":
            sampling.logit_bias[10**6] = 1.0
        with pytest.raises(RequestFailed) as caught:
            await generate_tokens(
                stub, common_pb2.GenerateRequest(request_id="bad", prompt_token_ids=[5, 6], sampling=sampling)
            )
        fine = await generate_tokens(
            stub, common_pb2.GenerateRequest(request_id="ok", prompt_token_ids=[5, 6], sampling=_sampling(1))
        )
        return caught.value, fine

    (error, fine), load = run_worker(model_dir, body, enable_prefix_caching=False)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert field in (error.details() or ""), error.details()
    assert fine[0]
    assert load.num_free_blocks == load.num_total_blocks


def test_grammar_failing_at_the_worker_is_the_requests_invalid_argument(model_dir: Path) -> None:
    """A constraint that passes the cheap check but fails when the worker builds its
    matcher (here: resumed tokens the grammar refuses) ends that request with a
    RequestError INVALID_ARGUMENT naming the field on the GenerateStream -- not an
    "abort" finish -- while the other request on the stream runs on; no block stays used."""
    letters = AutoTokenizer.from_pretrained(model_dir).encode("abc", add_special_tokens=False)
    bad = common_pb2.GenerateRequest(
        request_id="bad",
        prompt_token_ids=PROMPTS[0],
        sampling=common_pb2.SamplingParams(max_tokens=8, structured_kind="regex", structured_spec="[0-9]{3}"),
        resumed=[common_pb2.ResumedOutput(index=0, token_ids=letters)],
    )
    good = common_pb2.GenerateRequest(request_id="ok", prompt_token_ids=PROMPTS[1], sampling=_sampling(1))

    async def body(stub: worker_pb2_grpc.WorkerStub) -> list[worker_pb2.GenerateStreamResponse]:
        async def requests() -> AsyncIterator[worker_pb2.GenerateStreamRequest]:
            yield worker_pb2.GenerateStreamRequest(add=bad)
            yield worker_pb2.GenerateStreamRequest(add=good)

        return [message async for message in stub.GenerateStream(requests(), timeout=120)]

    messages, load = run_worker(model_dir, body, enable_prefix_caching=False)
    errors = {e.request_id: e for m in messages for e in m.errors}
    outputs = [o for m in messages for o in m.outputs]
    assert set(errors) == {"bad"}
    assert errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert errors["bad"].param == "structured_outputs" and "violates the grammar" in errors["bad"].message
    assert not [o for o in outputs if o.request_id == "bad"]  # no "abort" finish
    assert any(o.finished for o in outputs if o.request_id == "ok")
    assert load.num_free_blocks == load.num_total_blocks
