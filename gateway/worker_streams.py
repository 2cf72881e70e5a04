"""The gateway's end of the token path: ONE long-lived stream per worker this gateway
process talks to, shared by all its requests on that worker -- the worker's TCP token
stream (`Worker.OpenTokenStream`, framed protobuf on a plain TCP connection), or a
`Worker.GenerateStream` call where the worker offers none (the same messages).

Requests are added and aborted on the stream; the worker answers with at most one
message per engine step carrying the new output of every request that advanced, and
`WorkerStream` hands each request's part to that request's `RequestSink` --
synchronously, as the message is read, so one step's output for 32 requests costs one
message and no per-request hop. A broken stream (the worker died, hung or went away)
fails every request on it with `on_stream_lost`; the next request to that worker opens
a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from gateway import metrics
from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services import tls
from services.framing import FrameConnection
from services.rpc import KEEPALIVE_TIME_MS, PING_TIMEOUT_MS, open_channel

log = logging.getLogger(__name__)

# Connecting a stream (OpenTokenStream, then TCP) gives up after this: a hung worker's
# kernel still accepts connections.
CONNECT_TIMEOUT_S = 5.0
# A TCP token stream with requests running pings the worker this often.
BUSY_PING_S = 1.0

Dispatch = Callable[[worker_pb2.GenerateStreamResponse], None]


class RequestSink(Protocol):
    """Receives one request's part of the stream (called in the stream's reader task)."""

    def on_output(self, response: common_pb2.GenerateResponse) -> None:
        """New output; `response.finished` marks the request's last message."""

    def on_error(self, error: worker_pb2.RequestError) -> None:
        """The request failed as a whole on the worker (no more messages follow)."""

    def on_stream_lost(self, reason: str) -> None:
        """The stream broke (the worker died, or ended the stream): the request is gone."""


class _Link(Protocol):
    """The transport under a WorkerStream: the TCP token stream or a GenerateStream call."""

    async def send(self, message: worker_pb2.GenerateStreamRequest) -> None:
        """Writes one message (a broken link drops it: `run` reports the break)."""

    async def run(self) -> str:
        """Dispatches every message received until the link ends; returns why it ended."""

    def close(self) -> None:
        """Ends the link from this side."""


class _GrpcLink:
    """`Worker.GenerateStream`: messages written with `call.write` by whoever has one
    (one write at a time), not through a request iterator: no queue and no task between
    an add and the wire."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, dispatch: Dispatch) -> None:
        self._dispatch = dispatch
        self._writes = asyncio.Lock()
        # No deadline: the stream outlives requests (each request has its own deadline).
        self._call = stub.GenerateStream()

    async def send(self, message: worker_pb2.GenerateStreamRequest) -> None:
        async with self._writes:
            if self._call.done():
                return
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await self._call.write(message)

    async def run(self) -> str:
        try:
            async for message in self._call:
                self._dispatch(message)
        except grpc.aio.AioRpcError as exc:
            return _rpc_failure(exc)
        return "the worker ended the stream"

    def close(self) -> None:
        self._call.cancel()


class _TcpLink:
    """The token stream on the worker's TCP port (services.framing): frames are parsed
    and dispatched in the event loop's `data_received`. A ping goes out right after the
    hello, then every BUSY_PING_S while requests run on the stream and every
    KEEPALIVE_TIME_MS when none does; a worker that does not answer one within
    PING_TIMEOUT_MS (hung: its kernel still holds the connection) ends the link. A hung
    worker's requests fail within BUSY_PING_S + PING_TIMEOUT_MS (gRPC's keepalive: up
    to KEEPALIVE_TIME_MS + PING_TIMEOUT_MS)."""

    def __init__(self, dispatch: Dispatch, busy: Callable[[], bool], max_message_bytes: int) -> None:
        self._dispatch = dispatch
        self._busy = busy
        self._loop = asyncio.get_running_loop()
        self.conn = FrameConnection(self._on_frame, self._on_lost, max_message_bytes)
        self._ended: asyncio.Future[str] = self._loop.create_future()
        self._ping_id = 0
        self._timer: asyncio.TimerHandle | None = None
        self._next_ping = 0.0  # loop time of the next ping (0: one is out)

    @classmethod
    async def connect(
        cls,
        host: str,
        endpoint: worker_pb2.TokenStreamEndpoint,
        dispatch: Dispatch,
        busy: Callable[[], bool],
        max_message_bytes: int,
    ) -> _TcpLink:
        """Connects, says hello with the endpoint's ticket and sends the first ping."""
        link = cls(dispatch, busy, max_message_bytes)
        context = tls.client_ssl_context(tls.client_files())
        connecting = link._loop.create_connection(
            lambda: link.conn, host, endpoint.port, ssl=context, server_hostname=host if context else None
        )
        await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
        hello = worker_pb2.GenerateStreamRequest(hello=worker_pb2.TokenStreamHello(ticket=endpoint.ticket))
        link.conn.write(hello.SerializeToString())
        link._ping()
        return link

    async def send(self, message: worker_pb2.GenerateStreamRequest) -> None:
        self.conn.write(message.SerializeToString())
        if self._next_ping > self._loop.time() + BUSY_PING_S:  # idle until now: ping sooner
            self._schedule_ping(BUSY_PING_S)
        await self.conn.drain()

    async def run(self) -> str:
        return await self._ended

    def close(self) -> None:
        self.conn.close("the gateway closed the stream")

    def _ping(self) -> None:
        self._ping_id += 1
        self._next_ping = 0.0
        self.conn.write(worker_pb2.GenerateStreamRequest(ping=self._ping_id).SerializeToString())
        self._timer = self._loop.call_later(PING_TIMEOUT_MS / 1000, self._no_pong)

    def _schedule_ping(self, delay_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._next_ping = self._loop.time() + delay_s
        self._timer = self._loop.call_at(self._next_ping, self._ping)

    def _no_pong(self) -> None:
        self.conn.abort(f"UNAVAILABLE: the worker did not answer a ping within {PING_TIMEOUT_MS / 1000:g} s")

    def _on_frame(self, frame: bytes) -> None:
        try:
            message = worker_pb2.GenerateStreamResponse.FromString(frame)
        except DecodeError:
            self.conn.abort("INTERNAL: the worker sent an undecodable frame")
            return
        if message.HasField("pong"):
            if message.pong == self._ping_id and not self._next_ping:
                self._schedule_ping(BUSY_PING_S if self._busy() else KEEPALIVE_TIME_MS / 1000)
            return
        self._dispatch(message)

    def _on_lost(self, reason: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._ended.done():
            self._ended.set_result(reason)


def _rpc_failure(exc: grpc.aio.AioRpcError) -> str:
    """Why a stream failed, from the gRPC error that ended or prevented it."""
    return f"{exc.code().name}: {exc.details() or 'connection lost'}"


def _host(address: str) -> str:
    """The host of `host:port` (brackets of an IPv6 literal removed)."""
    return address.rsplit(":", 1)[0].strip("[]")


class WorkerStream:
    """One stream to a worker (TCP token stream, or GenerateStream where the worker does
    not offer one) and the sinks of the requests running on it."""

    def __init__(
        self,
        worker_id: str,
        address: str,
        stub: worker_pb2_grpc.WorkerStub,
        tcp: bool,
        max_message_bytes: int,
    ) -> None:
        self.worker_id = worker_id
        self.address = address
        self.closed = False
        self._sinks: dict[str, RequestSink] = {}
        self._link: _Link | None = None
        self._opened = asyncio.Event()  # the link is up, or will never be
        self._background: set[asyncio.Task[None]] = set()
        self._reader = asyncio.create_task(
            self._run(stub, tcp, max_message_bytes), name=f"worker-stream-{worker_id}"
        )

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
        if self._link is None:
            await self._opened.wait()
        if self._link is not None and not self.closed:
            await self._link.send(message)

    async def _open(self, stub: worker_pb2_grpc.WorkerStub, tcp: bool, max_message_bytes: int) -> _Link:
        """The TCP token stream when the worker offers one, else a GenerateStream call."""
        if tcp:
            try:
                endpoint = await stub.OpenTokenStream(
                    worker_pb2.OpenTokenStreamRequest(), timeout=CONNECT_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # an older worker: gRPC
                    raise
            else:
                if endpoint.port:
                    host, busy = _host(self.address), lambda: self.num_requests > 0
                    return await _TcpLink.connect(host, endpoint, self._dispatch, busy, max_message_bytes)
        return _GrpcLink(stub, self._dispatch)

    async def _run(self, stub: worker_pb2_grpc.WorkerStub, tcp: bool, max_message_bytes: int) -> None:
        reason = "the worker ended the stream"
        try:
            self._link = await self._open(stub, tcp, max_message_bytes)
            metrics.WORKER_STREAMS.labels("tcp" if isinstance(self._link, _TcpLink) else "grpc").inc()
            self._opened.set()
            reason = await self._link.run()
        except grpc.aio.AioRpcError as exc:
            reason = _rpc_failure(exc)
        except (OSError, TimeoutError) as exc:
            reason = f"UNAVAILABLE: cannot connect the token stream: {exc!r}"
        except asyncio.CancelledError:
            reason = "the gateway closed the stream"
        finally:
            self.closed = True
            self._opened.set()
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
        """Ends the stream (every request on it is lost)."""
        if self._link is not None:
            self._link.close()
        else:
            self._reader.cancel()


class WorkerStreams:
    """The gateway's streams by worker, opened on first use, reopened after a break."""

    def __init__(self, max_message_bytes: int, token_stream: bool = True) -> None:
        self._max_message_bytes = max_message_bytes
        # Use the workers' TCP token streams (False: GenerateStream calls only).
        self._token_stream = token_stream
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
            channel = self._channels[address] = open_channel(address, self._max_message_bytes)
        stub = worker_pb2_grpc.WorkerStub(channel)
        stream = WorkerStream(worker_id, address, stub, self._token_stream, self._max_message_bytes)
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
