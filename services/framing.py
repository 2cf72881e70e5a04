"""Length-prefixed protobuf frames on a plain asyncio TCP connection: the transport of
the token path's TCP stream (`Worker.OpenTokenStream` in worker.proto), shared by the
worker's server and the gateway's client.

A frame is a 4-byte little-endian length and that many bytes (one serialized message).
Why not gRPC: a gRPC message received by grpc.aio wakes three threads (the event-engine
thread reading the socket, grpc-aio's poller, the event loop) and costs ~0.25 ms of CPU
per send in C-core; a frame read here is parsed in the event loop's own `data_received`
(bench/transport_rtt.py: 0.06 vs 0.31 ms round trip back to back, 0.39 vs 0.81 ms after
20 ms idle).

A plaintext connection may also be written from another thread (`write_from_thread`:
the worker's engine thread sends a step's output itself, without waking the event loop
first). Both paths write under one lock, and the other thread sends on the socket only
while nothing is queued in the transport, so frames go out whole and in order.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import cast

HEADER = struct.Struct("<I")


class FrameConnection(asyncio.Protocol):
    """One connection. Incoming bytes are split into frames handed to `on_frame`
    synchronously, in the event loop (no queue, no task); `on_lost(reason)` is called
    once when the connection ends, whichever side ended it. Writes never block: `drain`
    waits while the peer does not read (the transport's buffer is over its high mark).
    With `thread_writes`, a plaintext connection also takes `write_from_thread`."""

    def __init__(
        self,
        on_frame: Callable[[bytes], None],
        on_lost: Callable[[str], None],
        max_frame_bytes: int,
        thread_writes: bool = False,
    ) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._reason = ""
        self.closed = False
        # Writes from another thread: a socket of our own on the connection's (a dup,
        # so it stays valid until connection_lost whatever the transport does with its
        # descriptor), the lock every write takes, and the frames handed to the loop
        # because the socket or the transport could not take them at once.
        self._thread_writes = thread_writes
        self._sock: socket.socket | None = None
        self._write_lock = threading.Lock()
        self._handoff: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- asyncio.Protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a TCP (or TLS) stream
        self._loop = asyncio.get_running_loop()
        raw = transport.get_extra_info("socket")
        if self._thread_writes and raw is not None and transport.get_extra_info("sslcontext") is None:
            self._sock = socket.socket(fileno=os.dup(raw.fileno()))
            self._sock.setblocking(False)

    def data_received(self, data: bytes) -> None:
        if self._buffer:
            self._buffer += data
            view = memoryview(self._buffer)
        else:
            view = memoryview(data)
        offset = self._split(view)
        rest = view[offset:].tobytes() if offset < len(view) else b""
        view.release()
        self._buffer = bytearray(rest)

    def _split(self, view: memoryview) -> int:
        """Hands every whole frame in `view` to `on_frame`; returns the bytes used."""
        offset, size = 0, len(view)
        while size - offset >= HEADER.size and not self.closed:
            (length,) = HEADER.unpack_from(view, offset)
            if length > self._max_frame_bytes:
                self.abort(f"a frame of {length} bytes is over the {self._max_frame_bytes}-byte limit")
                return size
            end = offset + HEADER.size + length
            if end > size:
                break
            self._on_frame(view[offset + HEADER.size : end].tobytes())
            offset = end
        return offset

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        with self._write_lock:
            self.closed = True
            self._handoff.clear()
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        self._writable.set()
        reason = self._reason or (
            f"connection lost: {exc}" if exc is not None else "the peer closed the connection"
        )
        self._on_lost(reason)

    # -- writing and closing ----------------------------------------------------------

    def write(self, payload: bytes) -> None:
        """Queues one frame (dropped once the connection is closed). Event loop only."""
        with self._write_lock:
            if self._transport is None or self.closed:
                return
            frame = HEADER.pack(len(payload)) + payload
            if self._handoff:  # frames from another thread go first
                self._handoff.append(frame)
            else:
                self._transport.write(frame)

    @property
    def thread_writable(self) -> bool:
        """`write_from_thread` would send at once: a plaintext connection, open, with
        nothing queued (a peer that does not keep up gets the loop's path, which waits
        on `drain`)."""
        return self._sock is not None and self._nothing_queued()

    def _nothing_queued(self) -> bool:
        """No frame waits in the hand-off or in the transport's buffer."""
        transport = self._transport
        return not self._handoff and transport is not None and not transport.get_write_buffer_size()

    def write_from_thread(self, payload: bytes) -> None:
        """Writes one frame from a thread other than the event loop's: straight to the
        socket while nothing else is queued, else after what is (handed to the loop)."""
        frame = HEADER.pack(len(payload)) + payload
        with self._write_lock:
            if self._sock is None or self._transport is None or self._loop is None:
                return  # closed (or not a plaintext connection): dropped, as `write` does
            sent = 0
            if self._nothing_queued():
                try:
                    sent = self._sock.send(frame)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return  # the connection broke: the loop reports it (connection_lost)
            if sent < len(frame):
                if not self._handoff:
                    self._loop.call_soon_threadsafe(self._flush_handoff)
                self._handoff.append(frame[sent:])

    def _flush_handoff(self) -> None:
        with self._write_lock:
            data, self._handoff = b"".join(self._handoff), []
            if data and self._transport is not None and not self.closed:
                self._transport.write(data)

    async def drain(self) -> None:
        """Waits until the peer has read enough of what was written (or the end)."""
        await self._writable.wait()

    def close(self, reason: str) -> None:
        """Ends the connection after what was written has gone out."""
        self._reason = self._reason or reason
        if self._transport is not None:
            self._transport.close()

    def abort(self, reason: str) -> None:
        """Ends the connection at once (what was written and not sent is dropped)."""
        self._reason = self._reason or reason
        self.closed = True
        if self._transport is not None:
            self._transport.abort()
