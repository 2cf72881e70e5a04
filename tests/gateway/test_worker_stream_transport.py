"""The gateway's `WorkerStreams` on a real worker: the TCP token stream where the worker
offers one, `GenerateStream` where it does not or the gateway is told not to use it --
the same tokens either way; and a worker that stops answering on the TCP stream (hung:
its kernel keeps the connection) is found by the ping and fails the stream's requests."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway import worker_streams
from gateway.worker_streams import WorkerStreams
from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.worker_svc.test_generate_stream import PROMPTS, _add, _unary_tokens
from tests.worker_svc.test_token_stream import _HEADER
from worker_svc.config import WorkerConfig
from worker_svc.main import WorkerProcess


class Sink:
    """A request's sink: its tokens, and how it ended."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ended = asyncio.Event()
        self.lost = ""

    def on_output(self, response: common_pb2.GenerateResponse) -> None:
        self.tokens += [t for d in response.deltas for t in d.token_ids]
        if response.finished:
            self.ended.set()

    def on_error(self, error: worker_pb2.RequestError) -> None:
        self.lost = f"error {error.message}"
        self.ended.set()

    def on_stream_lost(self, reason: str) -> None:
        self.lost = reason
        self.ended.set()


@pytest.mark.parametrize(
    ("worker_offers", "gateway_uses", "tcp"),
    [(True, True, True), (False, True, False), (True, False, False)],
    ids=["tcp", "worker-offers-none", "gateway-grpc-only"],
)
def test_stream_transport_and_output(
    tiny_model_dir: Path, worker_offers: bool, gateway_uses: bool, tcp: bool
) -> None:
    async def main() -> None:
        config = WorkerConfig(
            port=0,
            model_dir=str(tiny_model_dir),
            worker_id="wt",
            kv_cache_memory_mb=8,
            token_stream=worker_offers,
        )
        worker = WorkerProcess(config)
        await worker.start()
        streams = WorkerStreams(64 * 1024 * 1024, token_stream=gateway_uses)
        address = f"127.0.0.1:{worker.server.port}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                expected = [await _unary_tokens(worker_pb2_grpc.WorkerStub(channel), p) for p in PROMPTS[:2]]
            stream = streams.get("wt", address)
            sinks = [Sink(), Sink()]
            for i, sink in enumerate(sinks):
                await stream.add(_add(f"q{i}", PROMPTS[i]).add, sink)
            async with asyncio.timeout(60):
                for sink in sinks:
                    await sink.ended.wait()
            assert [s.tokens for s in sinks] == expected and not any(s.lost for s in sinks)
            assert worker.decoder is not None
            peers = worker.decoder.token_stream.peers if worker.decoder.token_stream is not None else set()
            assert len(peers) == (1 if tcp else 0)
            assert streams.get("wt", address) is stream  # one stream per worker, reused
        finally:
            await streams.close()
            await worker.server.server.stop(0)
            await worker.close()

    asyncio.run(main())


class _HangingWorker(worker_pb2_grpc.WorkerServicer):
    """Offers a token stream on a port whose peer answers `answers` pings and then
    nothing: a worker that hangs (SIGSTOPped: its kernel still holds the connection),
    which an in-process worker cannot do."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def OpenTokenStream(self, request: Any, context: Any) -> worker_pb2.TokenStreamEndpoint:
        return worker_pb2.TokenStreamEndpoint(port=self.port, ticket=b"t" * 16)


async def _hanging_peer(answers: int, pings: list[float]) -> asyncio.Server:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                message = worker_pb2.GenerateStreamRequest.FromString(await reader.readexactly(size))
            except asyncio.IncompleteReadError:
                return
            if message.WhichOneof("kind") == "ping":
                pings.append(asyncio.get_running_loop().time())
                if len(pings) <= answers:
                    reply = worker_pb2.GenerateStreamResponse(pong=message.ping).SerializeToString()
                    writer.write(_HEADER.pack(len(reply)) + reply)

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.mark.parametrize("answers", [0, 3], ids=["hung-from-the-start", "hangs-later"])
def test_hung_worker_is_found_by_the_ping(monkeypatch: pytest.MonkeyPatch, answers: int) -> None:
    """The first ping goes with the hello; while requests run, one every BUSY_PING_S;
    one left unanswered for PING_TIMEOUT_MS fails the stream's requests."""
    monkeypatch.setattr(worker_streams, "PING_TIMEOUT_MS", 300)
    monkeypatch.setattr(worker_streams, "BUSY_PING_S", 0.2)

    async def main() -> None:
        pings: list[float] = []
        peer = await _hanging_peer(answers, pings)
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(_HangingWorker(peer.sockets[0].getsockname()[1]), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        streams = WorkerStreams(1024 * 1024)
        try:
            stream = streams.get("hung", f"127.0.0.1:{port}")
            sink = Sink()
            await stream.add(_add("x", PROMPTS[0]).add, sink)
            started = asyncio.get_running_loop().time()
            async with asyncio.timeout(10):
                await sink.ended.wait()
            assert "did not answer a ping" in sink.lost and stream.closed
            assert len(pings) == answers + 1
            # Busy: pings 0.2 s apart (not KEEPALIVE_TIME_MS), the last one timed out.
            # (bounds far from KEEPALIVE_TIME_MS's 10 s, loose for a loaded machine)
            gaps = [b - a for a, b in itertools.pairwise(pings)]
            assert all(0.15 < gap < 5.0 for gap in gaps), gaps
            assert asyncio.get_running_loop().time() - started < 8.0
        finally:
            await streams.close()
            await server.stop(0)
            peer.close()

    asyncio.run(main())
