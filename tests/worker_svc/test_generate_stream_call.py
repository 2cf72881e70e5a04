"""GenerateStreamCall on a real engine: where its messages are built, and image requests (the
embedding fetch stands in for the encoder cache: a coroutine the test controls)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from meshserve.v1 import common_pb2, worker_pb2
from worker_svc import generate_stream
from worker_svc.engine import AsyncLLMEngine, EngineConfig
from worker_svc.engine.multimodal import MultiModalInput
from worker_svc.generate_stream import GenerateStreamCall

PROMPT = [5, 17, 33, 8, 90, 41, 7, 9]


def _request(request_id: str) -> common_pb2.GenerateRequest:
    item = common_pb2.MultiModalItem(identifier="img", modality="image", offset=2, length=3)
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return common_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling, mm_items=[item]
    )


async def _collect(call: GenerateStreamCall) -> list[worker_pb2.GenerateStreamResponse]:
    async with asyncio.timeout(60):
        return [message async for message in call.responses()]


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncLLMEngine:
    engine = AsyncLLMEngine(
        EngineConfig(model_dir=str(tiny_model_dir), num_kv_blocks=32, dtype="float32", compile_model=False)
    )
    yield engine
    await engine.shutdown()


async def test_half_closed_stream_waits_for_a_request_still_fetching_images(engine: AsyncLLMEngine) -> None:
    async def slow_fetch(request: common_pb2.GenerateRequest) -> list[MultiModalInput]:
        await asyncio.sleep(0.2)
        return []  # the test model is text-only: run the prompt as text

    call = GenerateStreamCall(engine, "w", "", 1, slow_fetch)
    call.add(_request("a"))
    call.add(_request("a"))  # the id is taken while its images are fetched
    call.input_done()  # the client half-closed: the stream must not end before "a" runs
    messages = await _collect(call)
    outputs = [o for m in messages for o in m.outputs]
    assert outputs and outputs[-1].finished and outputs[-1].usage.completion_tokens == 4
    [error] = [e for m in messages for e in m.errors]
    assert error.request_id == "a" and error.param == "request_id"


async def test_a_request_that_cannot_start_after_the_fetch_gets_an_error(engine: AsyncLLMEngine) -> None:
    async def bad_fetch(request: common_pb2.GenerateRequest) -> list[MultiModalInput]:
        return [MultiModalInput("img", 2, 3, torch.zeros(3, 1))]  # wrong hidden size

    call = GenerateStreamCall(engine, "w", "", 1, bad_fetch)
    call.add(_request("b"))
    call.input_done()
    messages = await _collect(call)
    [error] = [e for m in messages for e in m.errors]
    assert error.request_id == "b" and error.code == 3  # INVALID_ARGUMENT, not a silent hang
    assert not [o for m in messages for o in m.outputs]


async def test_messages_are_built_on_the_event_loop_not_the_engine_thread(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread hands over plain outputs; every protobuf of the token path (each
    sequence delta, each stream message) is built on the call's event loop."""
    threads: set[int] = set()
    delta, message = generate_stream.convert.sequence_delta, worker_pb2.GenerateStreamResponse

    def recorded(build: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            threads.add(threading.get_ident())
            return build(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(generate_stream.convert, "sequence_delta", recorded(delta))
    monkeypatch.setattr(generate_stream.worker_pb2, "GenerateStreamResponse", recorded(message))
    call = GenerateStreamCall(engine, "w", "", 1, None)
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=6, n=2, ignore_eos=True)
    for rid in ("a", "b"):
        call.add(common_pb2.GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling))
    call.input_done()
    outputs = [o for m in await _collect(call) for o in m.outputs]
    assert sum(len(d.token_ids) for o in outputs for d in o.deltas) == 2 * 2 * 6
    assert engine._thread is not None and engine._thread.ident not in threads
    assert threads == {threading.get_ident()}
