"""services.framing: length-prefixed frames come out whole and in order however the
bytes arrive (one at a time, many frames in one read), over a real loopback connection
too; a frame over the limit ends the connection."""

from __future__ import annotations

import asyncio
import threading

from services.framing import HEADER, FrameConnection


def _frames(*payloads: bytes) -> bytes:
    return b"".join(HEADER.pack(len(p)) + p for p in payloads)


def _collector(max_frame_bytes: int = 1024) -> tuple[FrameConnection, list[bytes], list[str]]:
    frames: list[bytes] = []
    lost: list[str] = []
    return FrameConnection(frames.append, lost.append, max_frame_bytes), frames, lost


def test_frames_survive_any_split() -> None:
    payloads = [b"first", b"", b"x" * 300, b"last one"]
    data = _frames(*payloads)
    for chunk in (1, 2, 3, 5, 7, len(data)):
        conn, frames, _ = _collector()
        for start in range(0, len(data), chunk):
            conn.data_received(data[start : start + chunk])
        assert frames == payloads, chunk


def test_an_oversized_frame_ends_the_connection() -> None:
    conn, frames, _ = _collector(max_frame_bytes=16)
    conn.data_received(_frames(b"ok") + HEADER.pack(17) + b"y" * 17 + _frames(b"never"))
    assert frames == [b"ok"] and conn.closed


def test_frames_over_a_real_connection_and_the_peer_closing() -> None:
    async def main() -> None:
        got: list[bytes] = []
        lost: list[str] = []
        three, closed = asyncio.Event(), asyncio.Event()

        def on_frame(frame: bytes) -> None:
            got.append(frame)
            if len(got) == 3:
                three.set()

        def on_lost(reason: str) -> None:
            lost.append(reason)
            closed.set()

        served: list[FrameConnection] = []

        def accept() -> FrameConnection:
            served.append(FrameConnection(on_frame, on_lost, 1 << 20))
            return served[-1]

        server = await asyncio.get_running_loop().create_server(accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = _collector(1 << 20)[0]
        await asyncio.get_running_loop().create_connection(lambda: client, "127.0.0.1", port)
        big = bytes(range(256)) * 1024  # 256 KiB: many reads on the other side
        for payload in (b"a", big, b"z"):
            client.write(payload)
        await client.drain()
        async with asyncio.timeout(10):
            await three.wait()
        assert got == [b"a", big, b"z"]
        client.close("done")
        async with asyncio.timeout(10):
            await closed.wait()
        assert lost == ["the peer closed the connection"] and served[0].closed
        server.close()

    asyncio.run(main())


class _Pair:
    """A served connection (`server`, thread writes as asked) and its client, whose
    frames land in `got`; `arrived(n)` waits for n of them."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self._more = asyncio.Event()
        self.client = FrameConnection(self._on_frame, lambda r: None, 1 << 20)
        self.client_transport: asyncio.BaseTransport | None = None

    def _on_frame(self, frame: bytes) -> None:
        self.got.append(frame)
        self._more.set()

    @classmethod
    async def open(cls, thread_writes: bool) -> tuple[_Pair, FrameConnection, asyncio.Server]:
        loop = asyncio.get_running_loop()
        pair, accepted = cls(), asyncio.Event()
        server_conn = FrameConnection(lambda f: None, lambda r: None, 1 << 20, thread_writes=thread_writes)
        real_made = server_conn.connection_made

        def made(transport: asyncio.BaseTransport) -> None:
            real_made(transport)
            accepted.set()

        server_conn.connection_made = made  # type: ignore[method-assign]
        server = await loop.create_server(lambda: server_conn, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pair.client_transport, _ = await loop.create_connection(lambda: pair.client, "127.0.0.1", port)
        async with asyncio.timeout(10):
            await accepted.wait()
        return pair, server_conn, server

    async def arrived(self, count: int, timeout: float = 30) -> None:
        async with asyncio.timeout(timeout):
            while len(self.got) < count:
                self._more.clear()
                await self._more.wait()


def test_writes_from_another_thread_stay_whole_and_in_order() -> None:
    """`write_from_thread` sends straight to the socket while nothing is queued; once the
    peer stops reading, its frames are handed to the loop, and a loop write made
    meanwhile goes after them: every frame arrives whole, in the order written."""

    async def main() -> None:
        pair, conn, server = await _Pair.open(thread_writes=True)
        assert conn.thread_writable and pair.client_transport is not None
        expected = [b"L1", *(b"T%03d" % i + bytes(64 * 1024) for i in range(200)), b"L2"]
        pair.client_transport.pause_reading()  # 13 MB do not fit the socket buffers: a hand-off
        conn.write(expected[0])
        # The loop waits for the thread without running: what the socket does not take
        # stays handed off, and the loop's next write must queue behind it.
        writer = threading.Thread(target=lambda: [conn.write_from_thread(f) for f in expected[1:-1]])
        writer.start()
        writer.join()
        assert conn._handoff
        assert not conn.thread_writable  # while anything is queued, steps take the loop's path
        conn.write(expected[-1])
        pair.client_transport.resume_reading()
        await pair.arrived(len(expected))
        assert [f[:4] for f in pair.got] == [f[:4] for f in expected]
        assert pair.got == expected
        assert conn.thread_writable  # all sent: the engine thread may write again
        pair.client.close("done")
        server.close()

    asyncio.run(main())


def test_a_connection_without_thread_writes_takes_none() -> None:
    async def main() -> None:
        pair, conn, server = await _Pair.open(thread_writes=False)
        assert not conn.thread_writable
        conn.write_from_thread(b"dropped")
        conn.write(b"kept")
        await pair.arrived(1, timeout=10)
        assert pair.got == [b"kept"]
        pair.client.close("done")
        server.close()

    asyncio.run(main())
