"""`GenerationRun`'s states with a scripted upstream (no gRPC): the lease is held exactly
while RUNNING and goes back once on every way off the worker; moves the lifecycle does
not allow raise."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.generation import GenerationRun, GenerationSpec, RunState
from gateway.upstream import LeaseGrant
from meshserve.v1 import common_pb2, worker_pb2


@dataclass
class FakeStream:
    added: list[str] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)

    async def add(self, request: common_pb2.GenerateRequest, sink: Any) -> None:
        self.added.append(request.lease_id)

    def abort(self, request_id: str) -> None:
        pass

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


class FakeTokenizer:
    def detokenizer(self, *args: Any) -> object:
        return object()


class FakeUpstream:
    """Leases l1, l2, ... on worker w (after `gate`, when set); records releases."""

    def __init__(self) -> None:
        self.timeout = 60.0
        self.config = type("Config", (), {"max_retries": 2, "max_migrations": 3})()
        self.stream = FakeStream()
        self.workers = type("Workers", (), {"get": lambda _self, worker_id, address: self.stream})()
        self.tokenizers = type("Tokenizers", (), {"get": self._tokenizer})()
        self.released: list[str] = []
        self.gate: asyncio.Event | None = None
        self._count = 0

    async def _tokenizer(self, model: str) -> FakeTokenizer:
        return FakeTokenizer()

    async def route(self, request: common_pb2.GenerateRequest, exclude: list[str], force: bool) -> LeaseGrant:
        if self.gate is not None:
            await self.gate.wait()
        self._count += 1
        return LeaseGrant(f"l{self._count}", "w", "w:1", [], 0)

    def release(self, lease: LeaseGrant) -> None:
        self.released.append(lease.lease_id)

    def note_usage(self, lease: LeaseGrant, usage: common_pb2.Usage) -> None:
        pass


def new_run(upstream: FakeUpstream) -> GenerationRun:
    spec = GenerationSpec("r1", "m", [1, 2], [], common_pb2.SamplingParams(), 1, [], False, True, 0, "")
    return GenerationRun(upstream, spec)  # type: ignore[arg-type]


async def test_lease_held_while_running_and_released_once() -> None:
    upstream = FakeUpstream()
    run = new_run(upstream)
    assert run.state is RunState.NEW
    await run.begin()
    assert run.state is RunState.RUNNING and upstream.stream.added == ["l1"] and upstream.released == []
    run.on_stream_lost("gone")
    assert run.state is RunState.ENDED and upstream.released == ["l1"]
    run.on_error(worker_pb2.RequestError(request_id="r1", code=14))  # late: ignored
    run.close()
    assert run.state is RunState.CLOSED and upstream.released == ["l1"]
    assert upstream.stream.forgotten == []  # the worker had already ended it
    run.close()  # idempotent
    await run.begin()  # begun once
    assert upstream.stream.added == ["l1"]


async def test_close_while_running_forgets_and_releases() -> None:
    upstream = FakeUpstream()
    run = new_run(upstream)
    await run.begin()
    run.close()
    assert run.state is RunState.CLOSED
    assert upstream.stream.forgotten == ["r1"] and upstream.released == ["l1"]


async def test_lease_arriving_after_close_goes_back_unused() -> None:
    upstream = FakeUpstream()
    upstream.gate = asyncio.Event()
    run = new_run(upstream)
    begun = asyncio.create_task(run.begin())
    await asyncio.sleep(0)
    assert run.state is RunState.ROUTING
    run.close()
    upstream.gate.set()
    await begun
    assert run.state is RunState.CLOSED and upstream.released == ["l1"] and upstream.stream.added == []


async def test_moves_the_lifecycle_does_not_allow_raise() -> None:
    upstream = FakeUpstream()
    run = new_run(upstream)
    with pytest.raises(RuntimeError, match="new -> running"):
        run._move(RunState.RUNNING)
    run.close()
    for state in RunState:
        with pytest.raises(RuntimeError, match="closed -> "):
            run._move(state)
