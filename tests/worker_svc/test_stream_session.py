"""StreamSession on a real engine: where its messages are built, and image requests (the
embedding fetch stands in for the encoder cache: a coroutine the test controls)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from meshserve.v1 import common_pb2, worker_pb2
from worker_svc import stream_session
from worker_svc.engine import AsyncLLMEngine, EngineConfig
from worker_svc.engine.multimodal import MultiModalInput
from worker_svc.stream_session import StreamSession

PROMPT = [5, 17, 33, 8, 90, 41, 7, 9]


def _request(request_id: str) -> common_pb2.GenerateRequest:
    item = common_pb2.MultiModalItem(identifier="img", modality="image", offset=2, length=3)
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return common_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling, mm_items=[item]
    )


async def _collect(session: StreamSession) -> list[worker_pb2.GenerateStreamResponse]:
    async with asyncio.timeout(60):
        return [message async for message in session.responses()]


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncLLMEngine:
    engine = AsyncLLMEngine(EngineConfig(model_dir=str(tiny_model_dir), num_kv_blocks=32, dtype="float32"))
    yield engine
    await engine.shutdown()


async def test_half_closed_stream_waits_for_a_request_still_fetching_images(engine: AsyncLLMEngine) -> None:
    async def slow_fetch(request: common_pb2.GenerateRequest) -> list[MultiModalInput]:
        await asyncio.sleep(0.2)
        return []  # the test model is text-only: run the prompt as text

    session = StreamSession(engine, "w", "", 1, slow_fetch)
    session.add(_request("a"))
    session.add(_request("a"))  # the id is taken while its images are fetched
    session.input_done()  # the client half-closed: the stream must not end before "a" runs
    messages = await _collect(session)
    outputs = [o for m in messages for o in m.outputs]
    assert outputs and outputs[-1].finished and outputs[-1].usage.completion_tokens == 4
    [error] = [e for m in messages for e in m.errors]
    assert error.request_id == "a" and error.param == "request_id"


async def test_a_request_that_cannot_start_after_the_fetch_gets_an_error(engine: AsyncLLMEngine) -> None:
    async def bad_fetch(request: common_pb2.GenerateRequest) -> list[MultiModalInput]:
        return [MultiModalInput("img", 2, 3, torch.zeros(3, 1))]  # wrong hidden size

    session = StreamSession(engine, "w", "", 1, bad_fetch)
    session.add(_request("b"))
    session.input_done()
    messages = await _collect(session)
    [error] = [e for m in messages for e in m.errors]
    assert error.request_id == "b" and error.code == 3  # INVALID_ARGUMENT, not a silent hang
    assert not [o for m in messages for o in m.outputs]


async def test_messages_are_built_on_the_event_loop_not_the_engine_thread(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread hands over plain outputs; every protobuf of the token path (each
    sequence delta, each stream message) is built on the session's event loop."""
    threads: set[int] = set()
    delta, message = stream_session.convert.sequence_delta, worker_pb2.GenerateStreamResponse

    def recorded(build: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            threads.add(threading.get_ident())
            return build(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(stream_session.convert, "sequence_delta", recorded(delta))
    monkeypatch.setattr(stream_session.worker_pb2, "GenerateStreamResponse", recorded(message))
    session = StreamSession(engine, "w", "", 1, None)
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=6, n=2, ignore_eos=True)
    for rid in ("a", "b"):
        session.add(common_pb2.GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling))
    session.input_done()
    outputs = [o for m in await _collect(session) for o in m.outputs]
    assert sum(len(d.token_ids) for o in outputs for d in o.deltas) == 2 * 2 * 6
    assert engine._thread is not None and engine._thread.ident not in threads
    assert threads == {threading.get_ident()}
