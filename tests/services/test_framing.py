"""services.framing: length-prefixed frames come out whole and in order however the
bytes arrive (one at a time, many frames in one read), over a real loopback connection
too; a frame over the limit ends the connection."""

from __future__ import annotations

import asyncio

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
