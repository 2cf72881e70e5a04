"""AsyncLLMEngine: engine thread, streaming, cancellation, failures."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.worker_engine.conftest import prompts, run_all, tokens
from worker_svc.engine import (
    AsyncLLMEngine,
    EngineStepError,
    LLMEngine,
    RequestOutput,
    RequestSpec,
    SamplingParams,
)

Factory = Callable[..., LLMEngine]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
async def make_async(make_engine: Factory) -> AsyncIterator[Callable[..., AsyncLLMEngine]]:
    engines: list[AsyncLLMEngine] = []

    def factory(**overrides: object) -> AsyncLLMEngine:
        engine = AsyncLLMEngine(engine=make_engine(**overrides))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        await engine.shutdown()


async def collect(
    engine: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [out async for out in engine.generate(RequestSpec(rid, prompt, params))]


async def wait_for_blocks_released(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.engine.block_manager.num_used_blocks() or engine.stats().num_running:
        assert time.monotonic() < deadline, "blocks were not released"
        await asyncio.sleep(0.01)


async def test_concurrent_generate_matches_sync(
    make_async: Callable[..., AsyncLLMEngine], make_engine: Factory
) -> None:
    ps = prompts(5, 21, 40, 9, seed=21)
    ref = run_all(make_engine(), [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)])
    engine = make_async()
    results = await asyncio.gather(*(collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(ps)))
    for i, outs in enumerate(results):
        assert tokens(outs) == tokens(ref[f"r{i}"])
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert all(len(o.new_token_ids) == 1 for o in outs)  # one output per step that produced a token
    await wait_for_blocks_released(engine)
    assert engine.stats().num_finished == len(ps)


async def test_with_async_scheduling_outputs_go_out_once_read_back(
    make_async: Callable[..., AsyncLLMEngine], make_engine: Factory
) -> None:
    """With async scheduling on CUDA (flagged so here), a step's outputs are read back
    after the next step's launch, so they go to the event loop at once, none held until
    another launch: the streams get the sync engine's tokens, each once."""
    ps = prompts(5, 21, 40, 9, seed=21)
    ref = run_all(make_engine(), [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)])
    engine = make_async(async_scheduling="on")
    engine.engine.runner.launches_async = True
    held_at_launch: list[bool] = []
    on_forward = engine.engine.runner.on_forward
    assert on_forward is not None

    def launched() -> None:
        held_at_launch.append(bool(engine._held))
        on_forward()

    engine.engine.runner.on_forward = launched
    results = await asyncio.gather(*(collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(ps)))
    for i, outs in enumerate(results):
        assert tokens(outs) == tokens(ref[f"r{i}"])
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert len(held_at_launch) >= GREEDY.max_tokens and not any(held_at_launch), held_at_launch
    await wait_for_blocks_released(engine)


async def test_outputs_go_out_while_the_next_forward_runs_where_it_runs_on_its_own(
    make_async: Callable[..., AsyncLLMEngine], make_engine: Factory
) -> None:
    """Where a forward runs on its own once launched (CUDA; flagged so here), a step's
    outputs reach the event loop while the next step's forward is under way, and only a
    step with none after it hands them over at once: the streams get the sync engine's
    tokens, each once, and an abort while outputs are held still ends its stream."""
    ps = prompts(5, 21, 40, 9, seed=21)
    ref = run_all(make_engine(), [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)])
    engine = make_async()
    runner = engine.engine.runner
    runner.launches_async = True
    handing_over = {"now": False}
    where: list[bool] = []  # per hand-over: inside a forward's launch or not
    on_forward, post = runner.on_forward, engine._post
    assert on_forward is not None

    def launched() -> None:
        handing_over["now"] = True
        on_forward()
        handing_over["now"] = False

    def recorded_post(batches: Any) -> None:
        where.append(handing_over["now"])
        post(batches)

    runner.on_forward = launched
    engine._post = recorded_post  # type: ignore[method-assign]
    results = await asyncio.gather(*(collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(ps)))
    for i, outs in enumerate(results):
        assert tokens(outs) == tokens(ref[f"r{i}"])
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert where.count(True) >= GREEDY.max_tokens - 1 and where.count(False) <= 2, where
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs: list[RequestOutput] = []
    async for out in engine.generate(RequestSpec("ab", ps[0], long)):
        outs.append(out)
        if len(outs) == 2:
            assert engine.abort("ab")
    assert outs[-1].finish_reason == "abort"
    await wait_for_blocks_released(engine)


async def test_invalid_input_raises_before_scheduling(make_async: Callable[..., AsyncLLMEngine]) -> None:
    engine = make_async()
    with pytest.raises(ValueError, match="temperature"):
        await collect(engine, "bad", [5, 6], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        await collect(engine, "bad", [], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(engine, "bad", [5] * 250, SamplingParams(max_tokens=10))
    assert engine.stats().num_waiting == 0 and engine.stats().num_running == 0


async def test_duplicate_request_id_rejected(make_async: Callable[..., AsyncLLMEngine]) -> None:
    engine = make_async()
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    gen = engine.generate(RequestSpec("dup", prompts(8)[0], long))
    first = await gen.__anext__()
    assert first.new_token_ids
    with pytest.raises(ValueError, match="request_id"):
        await collect(engine, "dup", [5], GREEDY)
    await gen.aclose()
    await wait_for_blocks_released(engine)


async def test_consumer_break_and_cancel_abort(make_async: Callable[..., AsyncLLMEngine]) -> None:
    engine = make_async()
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    gen = engine.generate(RequestSpec("brk", prompts(30)[0], long))
    async with contextlib.aclosing(gen):
        async for out in gen:
            if out.num_output_tokens >= 3:
                break
    await wait_for_blocks_released(engine)

    # Plain `break` without aclose: asyncio's async-generator finalizer closes it on GC.
    async for out in engine.generate(RequestSpec("gc", prompts(30)[0], long)):
        if out.num_output_tokens >= 2:
            break
    del out
    gc.collect()
    await wait_for_blocks_released(engine)

    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(RequestSpec("cxl", prompts(30)[0], long)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for_blocks_released(engine)
    assert engine.stats().num_aborted == 3


async def test_queued_prompt_tokens_count_a_request_before_the_engine_takes_it(
    make_async: Callable[..., AsyncLLMEngine],
) -> None:
    """A request submitted while the engine thread is busy (here: in a call; in service: a
    long prompt's step) counts in the queued prompt tokens at once, not only once a later
    snapshot has it; once it has run, nothing of it is counted twice."""
    engine = make_async()
    busy, release = threading.Event(), threading.Event()

    def hold(_: LLMEngine) -> None:
        busy.set()
        release.wait(10)

    held = asyncio.ensure_future(engine.call(hold))
    prompt = prompts(40)[0]
    try:
        assert await asyncio.to_thread(busy.wait, 10)
        before = engine.stats().queued_prompt_tokens
        collected = asyncio.ensure_future(collect(engine, "q", prompt, GREEDY))
        await asyncio.sleep(0)  # submitted (generate's first step)
        assert engine.stats().queued_prompt_tokens == before + len(prompt)
    finally:
        release.set()
    await held
    assert tokens(await collected)
    await wait_for_blocks_released(engine)
    assert engine.stats().queued_prompt_tokens == 0


async def test_abort_ends_stream_with_abort(make_async: Callable[..., AsyncLLMEngine]) -> None:
    engine = make_async()
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs: list[RequestOutput] = []
    async for out in engine.generate(RequestSpec("ab", prompts(10)[0], long)):
        outs.append(out)
        if len(outs) == 2:
            assert engine.abort("ab")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert not engine.abort("ab") and not engine.abort("unknown")
    await wait_for_blocks_released(engine)


async def test_step_error_fails_only_affected_and_loop_survives(
    make_async: Callable[..., AsyncLLMEngine],
) -> None:
    engine = make_async()
    runner = engine.engine.runner
    original = runner.execute
    calls = {"n": 0}

    def flaky(batch: list[object], ahead: object = None) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return original(batch, ahead)  # type: ignore[arg-type]

    runner.execute = flaky  # type: ignore[method-assign,assignment]
    with pytest.raises(EngineStepError, match="boom"):
        await collect(engine, "f", prompts(6)[0], GREEDY)
    runner.execute = original  # type: ignore[method-assign]
    outs = await collect(engine, "ok", prompts(6)[0], GREEDY)
    assert outs[-1].finished and len(tokens(outs)) == GREEDY.max_tokens
    await wait_for_blocks_released(engine)


async def test_engine_thread_idles_without_busy_loop(make_async: Callable[..., AsyncLLMEngine]) -> None:
    engine = make_async()
    engine.start()
    await collect(engine, "warm", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
    steps = engine.engine.num_steps
    thread = next(t for t in threading.enumerate() if t.name == "meshserve-engine")
    cpu = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - cpu < 0.1  # the engine thread sleeps on its command queue
    assert engine.engine.num_steps == steps
    assert thread.is_alive()


async def test_shutdown_fails_pending_requests(make_engine: Factory) -> None:
    engine = AsyncLLMEngine(engine=make_engine())
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    gen = engine.generate(RequestSpec("s", prompts(10)[0], long))
    await gen.__anext__()
    await engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        async for _ in gen:
            pass
    assert engine.engine.block_manager.num_used_blocks() == 0
    with pytest.raises(RuntimeError, match="shut down"):
        await collect(engine, "late", [5], GREEDY)
