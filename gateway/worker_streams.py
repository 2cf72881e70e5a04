"""The gateway's end of the token path: ONE long-lived `Worker.GenerateStream` per
worker this gateway process talks to, shared by all its requests on that worker.

Requests are added and aborted on the stream; the worker answers with at most one
message per engine step carrying the new output of every request that advanced, and
`WorkerStream` hands each request's part to that request's `RequestSink` -- in the
reader task, synchronously, so one step's output for 32 requests costs one gRPC message
and no per-request hop. A broken stream (the worker died, hung -- gRPC keepalive finds
it -- or went away) fails every request on it with `on_stream_lost`; the next request
to that worker opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import grpc

from gateway import metrics
from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.rpc import REQUEST_PING_MS, REQUEST_PING_TIMEOUT_MS, open_channel

log = logging.getLogger(__name__)


class RequestSink(Protocol):
    """Receives one request's part of the stream (called in the stream's reader task)."""

    def on_output(self, response: common_pb2.GenerateResponse) -> None:
        """New output; `response.finished` marks the request's last message."""

    def on_error(self, error: worker_pb2.RequestError) -> None:
        """The request failed as a whole on the worker (no more messages follow)."""

    def on_stream_lost(self, reason: str) -> None:
        """The stream broke (the worker died, or ended the stream): the request is gone."""


def _rpc_failure(exc: grpc.aio.AioRpcError) -> str:
    """Why a stream failed, from the gRPC error that ended or prevented it."""
    return f"{exc.code().name}: {exc.details() or 'connection lost'}"


class WorkerStream:
    """One GenerateStream call and the sinks of the requests running on it."""

    def __init__(self, worker_id: str, address: str, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.worker_id = worker_id
        self.address = address
        self.closed = False
        self._sinks: dict[str, RequestSink] = {}
        # Messages are written with `call.write` by whoever has one (one write at a time),
        # not through a request iterator: no queue and no task between an add and the wire.
        self._writes = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        # No deadline: the stream outlives requests (each request has its own deadline).
        self._call = stub.GenerateStream()
        metrics.WORKER_STREAMS.inc()
        self._reader = asyncio.create_task(self._read(), name=f"worker-stream-{worker_id}")

    async def add(self, request: common_pb2.GenerateRequest, sink: RequestSink) -> None:
        """Starts `request` on the worker; its output goes to `sink` (so does the loss of
        the stream, should the write find it broken)."""
        self._sinks[request.request_id] = sink
        await self._write(worker_pb2.GenerateStreamRequest(add=request))

    def abort(self, request_id: str) -> None:
        """Asks the worker to abort the request (its final message still arrives)."""
        if request_id in self._sinks:
            message = worker_pb2.GenerateStreamRequest(abort=common_pb2.AbortRequest(request_id=request_id))
            task = asyncio.get_running_loop().create_task(self._write(message))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def forget(self, request_id: str) -> None:
        """Aborts the request and drops its sink: nothing more is delivered for it."""
        self.abort(request_id)
        self._sinks.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._sinks)

    async def _write(self, message: worker_pb2.GenerateStreamRequest) -> None:
        # A broken stream is the reader's to report (on_stream_lost to every sink).
        async with self._writes:
            if self._call.done():
                return
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await self._call.write(message)

    async def _read(self) -> None:
        reason = "the worker ended the stream"
        try:
            async for message in self._call:
                self._dispatch(message)
        except grpc.aio.AioRpcError as exc:
            reason = _rpc_failure(exc)
        except asyncio.CancelledError:
            reason = "the gateway closed the stream"
        finally:
            self.closed = True
            sinks, self._sinks = self._sinks, {}
            if sinks:
                log.warning(
                    "stream to worker %s lost with %d requests: %s", self.worker_id, len(sinks), reason
                )
            for sink in sinks.values():
                sink.on_stream_lost(reason)

    def _dispatch(self, message: worker_pb2.GenerateStreamResponse) -> None:
        for output in message.outputs:
            # A forgotten request (its client went away) may still have output in flight.
            sink = self._sinks.get(output.request_id)
            if output.finished:
                self._sinks.pop(output.request_id, None)
            if sink is not None:
                sink.on_output(output)
        for error in message.errors:
            sink = self._sinks.pop(error.request_id, None)
            if sink is not None:
                sink.on_error(error)

    def close(self) -> None:
        """Cancels the call (every request on it is lost)."""
        self._call.cancel()


class WorkerStreams:
    """The gateway's streams by worker, opened on first use, reopened after a break."""

    def __init__(self, max_message_bytes: int) -> None:
        self._max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[str, WorkerStream] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, worker_id: str, address: str) -> WorkerStream:
        """The live stream to `worker_id` at `address` (a new one if none is)."""
        stream = self._streams.get(worker_id)
        if stream is not None and not stream.closed and stream.address == address:
            return stream
        if stream is not None:
            # The last stream broke: its channel may sit in reconnect backoff, failing new
            # calls at once even though the worker is back (restarted on the same address).
            self._drop_channel(stream.address)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(
                address, self._max_message_bytes, REQUEST_PING_MS, REQUEST_PING_TIMEOUT_MS
            )
        stream = WorkerStream(worker_id, address, worker_pb2_grpc.WorkerStub(channel))
        self._streams[worker_id] = stream
        return stream

    def _drop_channel(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            task = asyncio.get_running_loop().create_task(channel.close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Closes every stream and channel."""
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
