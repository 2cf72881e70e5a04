"""`Worker.GenerateStream`, the token path: many requests on one long-lived stream over
real gRPC on a real engine; one message carries the output of every request that
advanced in an engine step; errors are per request; aborts and a vanished client free
the KV blocks; a draining worker refuses new requests and ends the stream once idle."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.worker_svc.worker_kit import generate_one, settled_load, worker_process
from worker_svc.main import WorkerProcess

PROMPTS = [[5, 17, 33, 8, 90, 41, 7], [9, 3, 77, 12], [44, 45, 46, 47, 48, 49], [2, 300, 301]]
MAX_TOKENS = 12


def _add(
    request_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **fields: object
) -> worker_pb2.GenerateStreamRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return worker_pb2.GenerateStreamRequest(
        add=common_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, **fields
        )
    )


def _abort(request_id: str) -> worker_pb2.GenerateStreamRequest:
    return worker_pb2.GenerateStreamRequest(abort=common_pb2.AbortRequest(request_id=request_id))


@contextlib.asynccontextmanager
async def running_worker(
    model_dir: Path, **config: object
) -> AsyncIterator[tuple[WorkerProcess, worker_pb2_grpc.WorkerStub]]:
    """A worker process in this process (`config` adds WorkerConfig fields) and a stub."""
    settings: dict[str, object] = {"worker_id": "ws", "kv_cache_memory_mb": 8, "max_num_seqs": 8} | config
    worker = worker_process(model_dir, **settings)
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.server.port}") as channel:
            yield worker, worker_pb2_grpc.WorkerStub(channel)
    finally:
        await worker.server.server.stop(0)
        await worker.close()


class StreamMessages:
    """The messages a token path client received, by request."""

    def __init__(self) -> None:
        self.messages: list[worker_pb2.GenerateStreamResponse] = []

    def outputs(self, request_id: str) -> list[common_pb2.GenerateResponse]:
        return [o for m in self.messages for o in m.outputs if o.request_id == request_id]

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs(request_id) for d in o.deltas for t in d.token_ids]

    def finished(self, *request_ids: str) -> bool:
        return all(any(o.finished for o in self.outputs(r)) for r in request_ids)

    def errors(self) -> dict[str, worker_pb2.RequestError]:
        return {e.request_id: e for m in self.messages for e in m.errors}


class Client(StreamMessages):
    """One GenerateStream call: send messages, collect every response."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        super().__init__()
        self.outgoing: asyncio.Queue[worker_pb2.GenerateStreamRequest | None] = asyncio.Queue()
        self.call = stub.GenerateStream(self._requests())

    async def _requests(self) -> AsyncIterator[worker_pb2.GenerateStreamRequest]:
        while (message := await self.outgoing.get()) is not None:
            yield message

    def send(self, *messages: worker_pb2.GenerateStreamRequest) -> None:
        for message in messages:
            self.outgoing.put_nowait(message)

    async def read_until(self, done: Callable[[], bool], timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    return
                self.messages.append(message)


async def _solo_tokens(stub: worker_pb2_grpc.WorkerStub, prompt: list[int]) -> list[int]:
    """The tokens of `prompt` run alone on a stream of its own."""
    request = _add("solo", prompt).add
    return [t async for r in generate_one(stub, request, 60) for d in r.deltas for t in d.token_ids]


def run(body: Callable[..., Awaitable[None]], model_dir: Path) -> None:
    async def main() -> None:
        async with running_worker(model_dir) as (worker, stub):
            await body(worker, stub)

    asyncio.run(main())


def test_requests_share_one_stream_and_steps_are_batched(tiny_model_dir: Path) -> None:
    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        expected = [await _solo_tokens(stub, p) for p in PROMPTS]
        client = Client(stub)
        ids = [f"r{i}" for i in range(len(PROMPTS))]
        client.send(*(_add(rid, p, lease_id=f"lease-{rid}") for rid, p in zip(ids, PROMPTS, strict=True)))
        await client.read_until(lambda: bool(client.messages))
        decoder = worker.decoder
        assert decoder is not None and sorted(decoder.active_lease_ids()) == [f"lease-{r}" for r in ids]
        await client.read_until(lambda: client.finished(*ids))
        for rid, tokens in zip(ids, expected, strict=True):
            assert client.tokens(rid) == tokens  # greedy: same as one request per call
            last = client.outputs(rid)[-1]
            assert last.finished and last.usage.completion_tokens == MAX_TOKENS
            assert client.outputs(rid)[0].worker_id == "ws"
        # The four requests decode in the same engine steps: their outputs share messages.
        assert max(len(m.outputs) for m in client.messages) >= 2
        assert len(client.messages) < sum(len(client.outputs(r)) for r in ids)
        assert decoder.active_lease_ids() == []
        client.send(None)
        await client.read_until(lambda: False)  # the worker ends the call after the half-close
        assert await client.call.code() == grpc.StatusCode.OK

    run(body, tiny_model_dir)


def test_bad_request_fails_alone_and_abort_frees_blocks(tiny_model_dir: Path) -> None:
    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        client = Client(stub)
        # "long" asks for far more tokens than it gets before the abort, so it is still
        # running when its id is sent again (a 12-token request could finish first on a fast
        # machine and the second add would then be a new request, not a duplicate).
        client.send(_add("long", PROMPTS[0], max_tokens=1500), _add("bad", []), _add("ok", PROMPTS[1]))
        await client.read_until(lambda: "bad" in client.errors() and len(client.tokens("long")) >= 3)
        error = client.errors()["bad"]
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and error.param == "prompt"
        client.send(_add("long", PROMPTS[1]))  # the id is still running: refused, not merged
        client.send(_abort("long"))
        await client.read_until(lambda: client.finished("long", "ok") and "long" in client.errors())
        last = client.outputs("long")[-1]
        assert last.deltas[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert len(client.tokens("long")) < 1500
        assert len(client.tokens("ok")) == MAX_TOKENS
        load = await settled_load(worker)
        assert load.num_free_blocks == load.num_total_blocks, "the aborted request leaked KV blocks"
        client.send(None)

    run(body, tiny_model_dir)


def test_client_going_away_aborts_its_requests(tiny_model_dir: Path) -> None:
    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        client = Client(stub)
        client.send(_add("a", PROMPTS[0], max_tokens=400), _add("b", PROMPTS[2], max_tokens=400))
        await client.read_until(lambda: len(client.tokens("a")) >= 2)
        client.call.cancel()
        load = await settled_load(worker)
        assert load.num_running == 0 and load.num_free_blocks == load.num_total_blocks
        assert worker.engine is not None and worker.engine.stats().num_aborted == 2  # not run to the end

    run(body, tiny_model_dir)


def test_draining_worker_refuses_new_requests_and_ends_the_stream(tiny_model_dir: Path) -> None:
    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        client = Client(stub)
        client.send(_add("before", PROMPTS[0], max_tokens=40))
        await client.read_until(lambda: bool(client.tokens("before")))
        worker.server.draining = True
        worker.decoder.on_drain()  # type: ignore[union-attr]
        client.send(_add("after", PROMPTS[1]))
        await client.read_until(lambda: False)  # ends by itself: drained and idle
        assert client.errors()["after"].code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert len(client.tokens("before")) == 40  # the running request finished
        assert await client.call.code() == grpc.StatusCode.OK

    run(body, tiny_model_dir)


@pytest.mark.parametrize("interval", [3])
def test_stream_interval_applies_per_request(tiny_model_dir: Path, interval: int) -> None:
    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        worker.decoder.stream_interval = interval  # type: ignore[union-attr]
        client = Client(stub)
        client.send(_add("x", PROMPTS[0]), _add("y", PROMPTS[1]))
        await client.read_until(lambda: client.finished("x", "y"))
        for rid in ("x", "y"):
            outputs = client.outputs(rid)
            assert sum(len(d.token_ids) for o in outputs for d in o.deltas) == MAX_TOKENS
            for middle in outputs[1:-1]:
                assert sum(len(d.token_ids) for d in middle.deltas) >= interval
        client.send(None)

    run(body, tiny_model_dir)


def test_prompt_logprobs_come_once_with_the_first_token(tiny_model_dir: Path) -> None:
    """sampling.prompt_logprobs: one entry (with its rank and top-K) per prompt token after
    the first, in the message that carries the request's first token, for n samples too."""

    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        client = Client(stub)
        message = _add("plp", PROMPTS[0], max_tokens=3)
        message.add.sampling.n, message.add.sampling.prompt_logprobs = 2, 2
        client.send(message)
        await client.read_until(lambda: client.finished("plp"))
        outputs = client.outputs("plp")
        first = next(i for i, o in enumerate(outputs) if o.deltas and o.deltas[0].token_ids)
        assert [bool(o.prompt_logprobs) for o in outputs] == [i == first for i in range(len(outputs))]
        entries = outputs[first].prompt_logprobs
        assert [e.token_id for e in entries] == PROMPTS[0][1:]
        assert all(len(e.top) == 2 and e.rank >= 1 and e.logprob <= 0 for e in entries)
        assert all((e.rank == 1) == (e.top[0].token_id == e.token_id) for e in entries)

    run(body, tiny_model_dir)
