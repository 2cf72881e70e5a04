"""The token path on the worker's TCP port (`Worker.OpenTokenStream`): framed
GenerateStream messages over a real loopback connection to a real worker process and
engine. Same output as `Generate`, batched per engine step; a connection needs the
ticket; pings are answered; a closed connection, a bad frame or a drain end what they
should, and the KV blocks come back."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.framing import FrameConnection
from tests.worker_svc.test_generate_stream import (
    MAX_TOKENS,
    PROMPTS,
    StreamMessages,
    _abort,
    _add,
    _kv_idle,
    _unary_tokens,
    run,
    running_worker,
)
from worker_svc import token_stream
from worker_svc.main import WorkerProcess

_HEADER = struct.Struct("<I")


class TcpClient(StreamMessages):
    """One token stream connection: frames out, every message in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__()
        self.reader, self.writer = reader, writer
        self.pongs: list[int] = []
        self.eof = False

    @classmethod
    async def connect(cls, stub: worker_pb2_grpc.WorkerStub, ticket: bytes | None = None) -> TcpClient:
        endpoint = await stub.OpenTokenStream(worker_pb2.OpenTokenStreamRequest(), timeout=10)
        assert endpoint.port > 0 and len(endpoint.ticket) >= 16
        client = cls(*await asyncio.open_connection("127.0.0.1", endpoint.port))
        hello = worker_pb2.TokenStreamHello(ticket=endpoint.ticket if ticket is None else ticket)
        client.send(worker_pb2.GenerateStreamRequest(hello=hello))
        return client

    def send(self, *messages: worker_pb2.GenerateStreamRequest) -> None:
        for message in messages:
            self.send_raw(message.SerializeToString())

    def send_raw(self, payload: bytes) -> None:
        self.writer.write(_HEADER.pack(len(payload)) + payload)

    async def read_until(self, done: Callable[[], bool], timeout: float = 60.0) -> None:
        """Reads messages until `done()` or the worker closes the connection."""
        async with asyncio.timeout(timeout):
            while not done():
                try:
                    (size,) = _HEADER.unpack(await self.reader.readexactly(_HEADER.size))
                    frame = await self.reader.readexactly(size)
                except (asyncio.IncompleteReadError, ConnectionResetError):
                    self.eof = True
                    return
                message = worker_pb2.GenerateStreamResponse.FromString(frame)
                if message.HasField("pong"):
                    self.pongs.append(message.pong)
                else:
                    self.messages.append(message)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


def test_token_stream_output_equals_generate_and_is_batched(tiny_model_dir: Path) -> None:
    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        expected = [await _unary_tokens(stub, p) for p in PROMPTS]
        client = await TcpClient.connect(stub)
        ids = [f"r{i}" for i in range(len(PROMPTS))]
        client.send(*(_add(rid, p, lease_id=f"lease-{rid}") for rid, p in zip(ids, PROMPTS, strict=True)))
        await client.read_until(lambda: bool(client.messages))
        assert worker.decoder is not None
        assert sorted(worker.decoder.active_lease_ids()) == [f"lease-{r}" for r in ids]
        await client.read_until(lambda: client.finished(*ids))
        for rid, tokens in zip(ids, expected, strict=True):
            assert client.tokens(rid) == tokens  # greedy: the same as over gRPC
            assert client.outputs(rid)[-1].usage.completion_tokens == MAX_TOKENS
            assert client.outputs(rid)[0].worker_id == "ws"
        assert max(len(m.outputs) for m in client.messages) >= 2  # one message per step
        client.send(worker_pb2.GenerateStreamRequest(ping=41), worker_pb2.GenerateStreamRequest(ping=42))
        await client.read_until(lambda: len(client.pongs) == 2)
        assert client.pongs == [41, 42]
        await client.close()
        assert not client.eof

    run(body, tiny_model_dir)


def test_connection_without_the_ticket_is_closed_and_runs_nothing(tiny_model_dir: Path) -> None:
    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        wrong = await TcpClient.connect(stub, ticket=b"0" * 16)
        wrong.send(_add("sneaky", PROMPTS[0], max_tokens=200))
        await wrong.read_until(lambda: False, timeout=10)
        assert wrong.eof and not wrong.messages
        # No hello at all: an add first is refused the same way.
        endpoint = await stub.OpenTokenStream(worker_pb2.OpenTokenStreamRequest())
        bare = TcpClient(*await asyncio.open_connection("127.0.0.1", endpoint.port))
        bare.send(_add("sneaky2", PROMPTS[0], max_tokens=200))
        await bare.read_until(lambda: False, timeout=10)
        assert bare.eof and not bare.messages
        load = await stub.GetLoad(worker_pb2.GetLoadRequest())
        assert load.num_finished == 0 and load.num_running == 0 and load.num_waiting == 0

    run(body, tiny_model_dir)


@pytest.mark.parametrize("how", ["close", "garbage", "oversized"])
def test_connection_end_aborts_its_requests(tiny_model_dir: Path, how: str) -> None:
    """The client closes, or sends an undecodable or oversized frame: the worker drops
    the connection and aborts its requests (every KV block free again)."""

    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        client = await TcpClient.connect(stub)
        client.send(_add("a", PROMPTS[0], max_tokens=400), _add("b", PROMPTS[2], max_tokens=400))
        await client.read_until(lambda: len(client.tokens("a")) >= 2)
        if how == "close":
            await client.close()
        else:
            if how == "garbage":
                client.send_raw(b"\xff\xff\xff\xff not a message")
            else:
                client.writer.write(_HEADER.pack(65 * 1024 * 1024))  # over max_message_bytes
            await client.read_until(lambda: False, timeout=20)
            assert client.eof
        load = await _kv_idle(stub, timeout=20)
        assert load.num_running == 0
        assert worker.engine is not None and worker.engine.stats().num_aborted == 2  # not run to the end

    run(body, tiny_model_dir)


def test_abort_and_bad_request_on_the_token_stream(tiny_model_dir: Path) -> None:
    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        client = await TcpClient.connect(stub)
        client.send(_add("long", PROMPTS[0], max_tokens=1500), _add("bad", []), _add("ok", PROMPTS[1]))
        await client.read_until(lambda: "bad" in client.errors() and len(client.tokens("long")) >= 3)
        assert client.errors()["bad"].param == "prompt"
        client.send(_abort("long"))
        await client.read_until(lambda: client.finished("long", "ok"))
        assert client.outputs("long")[-1].deltas[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert len(client.tokens("ok")) == MAX_TOKENS
        await _kv_idle(stub)
        await client.close()

    run(body, tiny_model_dir)


def test_draining_worker_finishes_then_closes_and_refuses_new_streams(tiny_model_dir: Path) -> None:
    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        client = await TcpClient.connect(stub)
        client.send(_add("before", PROMPTS[0], max_tokens=40))
        await client.read_until(lambda: bool(client.tokens("before")))
        worker.server.draining = True
        assert worker.decoder is not None and worker.decoder.token_stream is not None
        worker.decoder.token_stream.stop_accepting()
        worker.decoder.on_drain()
        client.send(_add("after", PROMPTS[1]))
        await client.read_until(lambda: False)  # the worker closes the connection once idle
        assert client.eof
        assert client.errors()["after"].code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert len(client.tokens("before")) == 40
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.OpenTokenStream(worker_pb2.OpenTokenStreamRequest())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    run(body, tiny_model_dir)


def test_token_stream_off_offers_no_port(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running_worker(tiny_model_dir, token_stream=False) as (_, stub):
            endpoint = await stub.OpenTokenStream(worker_pb2.OpenTokenStreamRequest())
            assert endpoint.port == 0 and not endpoint.ticket

    asyncio.run(main())


def test_a_silent_client_is_dropped_and_a_pinging_one_is_not(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends nothing (not even pings) for SILENCE_LIMIT_S is hung: the
    worker closes its connection and aborts its requests; pings keep a connection open."""
    monkeypatch.setattr(token_stream, "SILENCE_LIMIT_S", 0.6)

    async def body(worker: WorkerProcess, stub: worker_pb2_grpc.WorkerStub) -> None:
        assert worker.engine is not None
        pinging, silent = await TcpClient.connect(stub), await TcpClient.connect(stub)
        pinging.send(_add("kept", PROMPTS[1], max_tokens=1500))
        silent.send(_add("dropped", PROMPTS[0], max_tokens=1500))
        await silent.read_until(lambda: bool(silent.tokens("dropped")))
        for i in range(12):  # 1.2 s: twice the limit
            pinging.send(worker_pb2.GenerateStreamRequest(ping=i))
            await asyncio.sleep(0.1)
        await silent.read_until(lambda: False, timeout=10)
        assert silent.eof
        await pinging.read_until(lambda: len(pinging.pongs) == 12, timeout=10)
        assert not pinging.eof and pinging.tokens("kept")
        assert worker.engine.stats().num_aborted == 1  # "dropped" only
        await pinging.close()

    run(body, tiny_model_dir)


def test_small_steps_are_written_from_the_engine_thread_in_order(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with at most `inline_output_max` outputs for the connection is written by
    the engine thread itself; bigger ones go through the event loop. Requests whose
    steps switch between the two paths still get every token, in order."""
    writers: list[tuple[str, int]] = []  # (writing thread, outputs in the frame) per message

    def spy(write: Callable[[FrameConnection, bytes], None]) -> Callable[[FrameConnection, bytes], None]:
        def spied(self: FrameConnection, payload: bytes) -> None:
            message = worker_pb2.GenerateStreamResponse.FromString(payload)
            if message.outputs:
                writers.append((threading.current_thread().name, len(message.outputs)))
            write(self, payload)

        return spied

    monkeypatch.setattr(FrameConnection, "write", spy(FrameConnection.write))
    monkeypatch.setattr(FrameConnection, "write_from_thread", spy(FrameConnection.write_from_thread))
    lengths = [3, 6, 9, 12]  # 4, then 3, 2 and 1 requests left in the batch

    async def main() -> None:
        async with running_worker(tiny_model_dir, inline_output_max=2) as (_, stub):
            expected = [await _unary_tokens(stub, p) for p in PROMPTS]
            writers.clear()
            client = await TcpClient.connect(stub)
            ids = [f"r{i}" for i in range(len(PROMPTS))]
            client.send(*(_add(rid, p, n) for rid, p, n in zip(ids, PROMPTS, lengths, strict=True)))
            await client.read_until(lambda: client.finished(*ids))
            for rid, tokens, n in zip(ids, expected, lengths, strict=True):
                assert client.tokens(rid) == tokens[:n]
            await client.close()

    asyncio.run(main())
    engine_thread = {n for name, n in writers if name == "meshserve-engine"}
    loop_thread = {n for name, n in writers if name != "meshserve-engine"}
    assert engine_thread and max(engine_thread) <= 2  # the small steps, from the engine thread
    assert loop_thread and max(loop_thread) > 2  # the big ones through the loop


def test_inline_output_max_0_writes_every_step_from_the_loop(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    write = FrameConnection.write_from_thread

    def spied(self: FrameConnection, payload: bytes) -> None:
        threads.append(threading.current_thread().name)
        write(self, payload)

    monkeypatch.setattr(FrameConnection, "write_from_thread", spied)

    async def main() -> None:
        async with running_worker(tiny_model_dir, inline_output_max=0) as (_, stub):
            client = await TcpClient.connect(stub)
            client.send(_add("one", PROMPTS[0]))
            await client.read_until(lambda: client.finished("one"))
            assert len(client.tokens("one")) == MAX_TOKENS
            await client.close()

    asyncio.run(main())
    assert threads == []
