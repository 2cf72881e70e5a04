"""The floor under the mesh's added TTFT at concurrency 1: one streamed HTTP request with
nothing behind it, through the same client `mesh_overhead` uses.

    python -m bench.http_floor [--requests 300 --gaps-ms 0,20 --repeats 3]
        --out bench/results/http_floor.json

`mesh_overhead` measures the in-process engine with a Python call and the mesh through
HTTP (aiohttp client → gateway → worker → gateway → client), so the mesh's "TTFT added"
includes one HTTP round trip however little the mesh does. This measures that round
trip alone: a `/v1/completions`-shaped POST (128 token ids, `stream: true`) answered at
once with one SSE text event and `[DONE]`, from a server in a child process, two ways:

- `raw`: a bare asyncio Protocol on uvloop that finds the body by Content-Length and
  writes the whole chunked answer in one write (the least an HTTP server can do here);
- `uvicorn`: uvicorn (httptools, uvloop, as the gateway runs it) with a bare ASGI app
  that reads the body, parses the JSON and sends the same two events.

Reported: median time to the first text event per server and gap (median over repeats
of each run's median; the first 20 requests of a run are warm-up). A gap between
requests lets the processes go idle, as they are between requests at low load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import uvicorn
import uvloop

from bench.report import save

_WARMUP = 20
_EVENT = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
_DONE = b"data: [DONE]\n\n"


async def _asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads and parses the body, answers one text event and [DONE]."""
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    json.loads(body)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    await send({"type": "http.response.body", "body": _EVENT, "more_body": True})
    await send({"type": "http.response.body", "body": _DONE, "more_body": False})


class _RawHttp(asyncio.Protocol):
    """Just enough HTTP/1.1 for this client: Content-Length bodies, keep-alive."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head, sep, rest = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        if len(rest) < length:
            return
        self.buffer = rest[length:]
        json.loads(rest[:length])
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (_EVENT, _DONE))
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunks
            + b"0\r\n\r\n"
        )


def _serve(kind: str, sock: socket.socket) -> None:
    """Child process: serves on the listening socket until killed."""
    if kind == "uvicorn":
        config = uvicorn.Config(
            _asgi_app, loop="uvloop", http="httptools", log_level="warning", lifespan="off"
        )
        uvicorn.Server(config).run(sockets=[sock])
        return

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_RawHttp, sock=sock)
        await server.serve_forever()

    uvloop.run(main())


async def _ttfts(port: int, requests: int, gap_s: float) -> list[float]:
    """Time to the first text event of each request, one at a time on one connection."""
    body = {"model": "m", "prompt": list(range(1000, 1128)), "max_tokens": 8, "stream": True}
    ttfts = []
    async with aiohttp.ClientSession() as client:
        for _ in range(requests + _WARMUP):
            if gap_s:
                await asyncio.sleep(gap_s)
            start = time.monotonic()
            first = None
            async with client.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as reply:
                reply.raise_for_status()
                async for line in reply.content:
                    if first is None and b'"text"' in line:
                        first = time.monotonic()
            if first is None:
                raise RuntimeError("no text event")
            ttfts.append(first - start)
    return ttfts[_WARMUP:]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (repeat, gap, server) run, servers alternating; returns the report."""
    gaps = [float(g) for g in args.gaps_ms.split(",")]
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for gap in gaps:
            for kind in ("raw", "uvicorn"):
                sock = socket.create_server(("127.0.0.1", 0))
                child = multiprocessing.get_context("spawn").Process(
                    target=_serve, args=(kind, sock), daemon=True
                )
                child.start()
                try:
                    ttfts = asyncio.run(_ttfts(sock.getsockname()[1], args.requests, gap / 1000))
                finally:
                    child.kill()
                    child.join()
                    sock.close()
                median = statistics.median(ttfts) * 1000
                runs.append({"repeat": repeat, "gap_ms": gap, "server": kind, "ttft_ms_p50": median})
                print(f"repeat {repeat} gap {gap:g} ms {kind}: {median:.3f} ms", flush=True)
    summary = [
        {"gap_ms": gap}
        | {
            f"{kind}_ttft_ms_median": statistics.median(
                r["ttft_ms_p50"] for r in runs if r["gap_ms"] == gap and r["server"] == kind
            )
            for kind in ("raw", "uvicorn")
        }
        for gap in gaps
    ]
    return {"requests": args.requests, "repeats": args.repeats, "summary": summary, "runs": runs}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--gaps-ms", default="0,20", help="idle time between requests")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/http_floor.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    if args.repeats < 1 or args.requests < 1:
        raise SystemExit("--repeats and --requests must be >= 1")
    report = save("bench.http_floor", argv, run(args), args.out)
    for row in report["summary"]:
        print(
            f"gap {row['gap_ms']:g} ms: raw server {row['raw_ttft_ms_median']:.3f} ms, "
            f"uvicorn {row['uvicorn_ttft_ms_median']:.3f} ms to the first event"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
