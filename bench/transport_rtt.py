"""Round trip of one small worker-stream message: gRPC (grpc.aio bidi stream,
`Worker.GenerateStream`) vs a length-prefixed protobuf frame on a plain asyncio TCP
stream (the framed token stream the worker once offered, since removed: the token path is
`Worker.GenerateStream` only).

    python -m bench.transport_rtt [--messages 400 --gaps-ms 0,20 --repeats 3]
        --out bench/results/transport_rtt.json

The server runs in a child process and answers each `GenerateStreamRequest` with a
one-token `GenerateStreamResponse`; both sides run uvloop, as the services do. A gap
between messages lets the threads go idle, as the prefill does between a request's add
and its first token at concurrency 1. Reported: median round trip per transport and gap
(median over repeats of each run's median; the first 20 messages of a run are warm-up).
Why: the c=1 hop traces (bench/README, session 11) put ~0.3-0.45 ms on each gRPC hop;
this measures what the transport itself costs, with nothing else in the processes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import struct
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import uvloop

from bench.report import save
from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

_WARMUP = 20
_FRAME = struct.Struct("<I")


def _reply() -> worker_pb2.GenerateStreamResponse:
    reply = worker_pb2.GenerateStreamResponse()
    output = reply.outputs.add(request_id="cmpl-0123456789abcdef")
    output.deltas.add(token_ids=[1234])
    return reply


def _request() -> worker_pb2.GenerateStreamRequest:
    return worker_pb2.GenerateStreamRequest(abort=common_pb2.AbortRequest(request_id="cmpl-0123456789abcdef"))


class _Echo(worker_pb2_grpc.WorkerServicer):
    async def GenerateStream(
        self, request_iterator: AsyncIterator[worker_pb2.GenerateStreamRequest], context: Any
    ) -> None:
        """One reply per request message."""
        async for _ in request_iterator:
            await context.write(_reply())


async def _grpc_server(port: int) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(_Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _tcp_server(port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
            worker_pb2.GenerateStreamRequest.FromString(await reader.readexactly(size))
            body = _reply().SerializeToString()
            writer.write(_FRAME.pack(len(body)) + body)

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    await server.serve_forever()


async def _grpc_client(port: int, messages: int, gap_s: float) -> list[float]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    await channel.channel_ready()
    call = worker_pb2_grpc.WorkerStub(channel).GenerateStream()
    rtts = []
    for _ in range(messages):
        start = time.perf_counter()
        await call.write(_request())
        await call.read()
        rtts.append((time.perf_counter() - start) * 1e3)
        await asyncio.sleep(gap_s)
    call.cancel()
    await channel.close()
    return rtts


async def _tcp_client(port: int, messages: int, gap_s: float) -> list[float]:
    for _ in range(100):  # the child may still be binding
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            break
        except OSError:
            await asyncio.sleep(0.05)
    else:
        raise ConnectionError(f"no TCP server on port {port} after 5 s")
    rtts = []
    for _ in range(messages):
        start = time.perf_counter()
        body = _request().SerializeToString()
        writer.write(_FRAME.pack(len(body)) + body)
        (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
        worker_pb2.GenerateStreamResponse.FromString(await reader.readexactly(size))
        rtts.append((time.perf_counter() - start) * 1e3)
        await asyncio.sleep(gap_s)
    writer.close()
    return rtts


def _serve(transport: str, port: int) -> None:
    uvloop.run(_grpc_server(port) if transport == "grpc" else _tcp_server(port))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_run(transport: str, messages: int, gap_s: float) -> float:
    """Median round trip (ms) of one run against a fresh server process."""
    port = _free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(transport, port), daemon=True)
    server.start()
    try:
        client = _grpc_client if transport == "grpc" else _tcp_client
        rtts = uvloop.run(client(port, messages + _WARMUP, gap_s))
    finally:
        server.terminate()
        server.join()
    return statistics.median(rtts[_WARMUP:])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every transport × gap, repeats alternating the transports."""
    gaps = [float(g) for g in args.gaps_ms.split(",")]
    results: dict[str, dict[str, list[float]]] = {"grpc": {}, "tcp": {}}
    for gap in gaps:
        for repeat in range(args.repeats):
            order = ("grpc", "tcp") if repeat % 2 == 0 else ("tcp", "grpc")
            for transport in order:
                rtt = one_run(transport, args.messages, gap / 1000)
                results[transport].setdefault(str(gap), []).append(rtt)
                print(f"gap {gap:g} ms {transport}: round trip p50 {rtt:.3f} ms", flush=True)
    summary = [
        {
            "gap_ms": gap,
            "grpc_rtt_ms_median": statistics.median(results["grpc"][str(gap)]),
            "tcp_rtt_ms_median": statistics.median(results["tcp"][str(gap)]),
        }
        for gap in gaps
    ]
    return {"messages": args.messages, "repeats": args.repeats, "summary": summary, "runs": results}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=400)
    p.add_argument("--gaps-ms", default="0,20", help="idle time between messages")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/transport_rtt.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    report = save("bench.transport_rtt", argv, run(args), args.out)
    for row in report["summary"]:
        print(
            f"gap {row['gap_ms']:g} ms: gRPC {row['grpc_rtt_ms_median']:.3f} ms, "
            f"TCP frame {row['tcp_rtt_ms_median']:.3f} ms round trip"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
