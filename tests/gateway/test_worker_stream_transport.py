"""The gateway's `WorkerStreams` on a real worker: one `GenerateStream` per worker,
shared by its requests, with the tokens each request gets on its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from gateway.worker_streams import WorkerStreams
from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.config import MAX_MESSAGE_BYTES
from tests.worker_svc.test_generate_stream import PROMPTS, _add, _solo_tokens
from tests.worker_svc.worker_kit import worker_process


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


def test_stream_output_and_reuse(tiny_model_dir: Path) -> None:
    """Two requests on the gateway's one stream to a worker get the tokens a request of
    their own gets, and the stream is reused."""

    async def main() -> None:
        worker = worker_process(tiny_model_dir, worker_id="wt", kv_cache_memory_mb=8)
        await worker.start()
        streams = WorkerStreams(MAX_MESSAGE_BYTES)
        address = f"127.0.0.1:{worker.server.port}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                expected = [await _solo_tokens(worker_pb2_grpc.WorkerStub(channel), p) for p in PROMPTS[:2]]
            stream = streams.get("wt", address)
            sinks = [Sink(), Sink()]
            for i, sink in enumerate(sinks):
                await stream.add(_add(f"q{i}", PROMPTS[i]).add, sink)
            async with asyncio.timeout(60):
                for sink in sinks:
                    await sink.ended.wait()
            assert [s.tokens for s in sinks] == expected and not any(s.lost for s in sinks)
            assert streams.get("wt", address) is stream  # one stream per worker, reused
        finally:
            await streams.close()
            await worker.server.server.stop(0)
            await worker.close()

    asyncio.run(main())
