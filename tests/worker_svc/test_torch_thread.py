"""TorchThread: a role's model build and forwards on one thread, one call at a time."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from worker_svc.torch_thread import TorchThread


async def test_calls_run_in_order_on_one_thread_off_the_loop() -> None:
    thread = TorchThread("meshserve-test")
    try:
        seen: list[tuple[str, int]] = []

        def work(tag: str, delay: float = 0.0) -> str:
            seen.append((tag, threading.get_native_id()))
            time.sleep(delay)
            seen.append((tag, threading.get_native_id()))
            return tag.upper()

        results = await asyncio.gather(
            thread.run(work, "build", delay=0.05), thread.run(work, "a", 0.01), thread.run(work, "b")
        )
        assert results == ["BUILD", "A", "B"]
        assert [tag for tag, _ in seen] == ["build", "build", "a", "a", "b", "b"]  # never interleaved
        assert len({tid for _, tid in seen}) == 1
        assert seen[0][1] != threading.get_native_id()
    finally:
        thread.shutdown()


async def test_an_exception_reaches_the_caller() -> None:
    thread = TorchThread("meshserve-test")
    try:

        def fail() -> None:
            raise ValueError("bad input")

        with pytest.raises(ValueError, match="bad input"):
            await thread.run(fail)
        assert await thread.run(lambda: 7) == 7  # the thread outlives a failed call
    finally:
        thread.shutdown()
