"""services.rpc.peer_lost: a call whose peer is gone (worth another replica) told apart from
a peer's own error by the status code alone, on real failures: a refused connection, a
server process killed mid-call, a server stopped mid-call, and the errors a live peer
answers (its exception, INTERNAL, INVALID_ARGUMENT)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import AsyncIterator

import grpc
import pytest

from meshserve.v1 import common_pb2, worker_pb2_grpc
from services.ports import free_port
from services.rpc import peer_lost

pytestmark = pytest.mark.timeout(60)

# A Worker whose Embed never answers, in a process of its own (killed mid-call below).
_HANGING_SERVER = textwrap.dedent(
    """
    import asyncio, sys
    import grpc
    from meshserve.v1 import worker_pb2_grpc

    class Hang(worker_pb2_grpc.WorkerServicer):
        async def Embed(self, request, context):
            await asyncio.sleep(3600)

    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(Hang(), server)
        server.add_insecure_port("127.0.0.1:" + sys.argv[1])
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())
    """
)


class _Peer(worker_pb2_grpc.WorkerServicer):
    """Embed fails the way request_id says, or hangs ("hang")."""

    async def Embed(self, request: common_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> None:
        if request.request_id == "raise":
            raise RuntimeError("a bug in the peer")
        if request.request_id == "hang":
            await asyncio.sleep(3600)
        code = grpc.StatusCode[request.request_id]
        await context.abort(code, "Received RST_STREAM with error code 2")  # details do not matter


@pytest.fixture
async def peer() -> AsyncIterator[tuple[grpc.aio.Server, worker_pb2_grpc.WorkerStub]]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(_Peer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield server, worker_pb2_grpc.WorkerStub(channel)
    await server.stop(0)


async def _failure(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


async def test_a_peers_own_errors_are_not_lost_peers(
    peer: tuple[grpc.aio.Server, worker_pb2_grpc.WorkerStub],
) -> None:
    _, stub = peer
    for request_id in ("raise", "INTERNAL", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"):
        exc = await _failure(stub.Embed(common_pb2.EmbedRequest(request_id=request_id), timeout=10))
        assert not peer_lost(exc), (request_id, exc.code(), exc.details())


async def test_refused_and_stopped_peers_are_lost(
    peer: tuple[grpc.aio.Server, worker_pb2_grpc.WorkerStub],
) -> None:
    server, stub = peer
    async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        refused = await _failure(
            worker_pb2_grpc.WorkerStub(channel).Embed(common_pb2.EmbedRequest(), timeout=10)
        )
    assert peer_lost(refused), (refused.code(), refused.details())
    call = stub.Embed(common_pb2.EmbedRequest(request_id="hang"), timeout=10)
    await asyncio.sleep(0.3)
    await server.stop(0)
    stopped = await _failure(call)
    assert peer_lost(stopped), (stopped.code(), stopped.details())


async def test_a_peer_killed_mid_call_is_lost() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HANGING_SERVER, str(port), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and (await proc.stdout.readline()).strip() == b"ready"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Embed(common_pb2.EmbedRequest(), timeout=20)
            await asyncio.sleep(0.5)
            proc.kill()
            killed = await _failure(call)
        assert peer_lost(killed), (killed.code(), killed.details())
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
