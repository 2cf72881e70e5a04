"""Shared runtime: config loading, error mapping, health, and signal-free drain."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.v1 import worker_pb2, worker_pb2_grpc
from services.config import ServerConfig, env_for, load_config
from services.errors import Code, InvalidArgument, Overloaded, classify
from services.rpc import error_from_rpc, rpc_handler
from services.server import GrpcServer


@dataclasses.dataclass(frozen=True)
class DemoConfig(ServerConfig):
    model_dir: str = ""
    names: tuple[str, ...] = ()
    enabled: bool = False


def test_config_flags_override_env_override_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_PORT", "1234")
    monkeypatch.setenv("MESHSERVE_NAMES", "a, b")
    monkeypatch.setenv("MESHSERVE_ENABLED", "yes")
    config = load_config(DemoConfig, ["--model-dir", "/m", "--port", "99"])
    assert config.port == 99 and config.model_dir == "/m"
    assert config.names == ("a", "b") and config.enabled is True
    assert env_for(config)["MESHSERVE_NAMES"] == "a,b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]


def test_config_validation_names_the_field() -> None:
    with pytest.raises(SystemExit):
        load_config(DemoConfig, ["--port", "70000"])
    with pytest.raises(ValueError, match="tracing"):
        ServerConfig(tracing="bogus")


def test_error_classification() -> None:
    assert classify(ValueError("temperature must be finite")) == (
        Code.INVALID_ARGUMENT,
        "temperature must be finite",
    )
    assert classify(Overloaded("queue full"))[0] is Code.RESOURCE_EXHAUSTED
    code, message = classify(RuntimeError("secret detail"))
    assert code is Code.INTERNAL and "secret" not in message


class SlowWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.started = asyncio.Event()

    @rpc_handler
    async def LoadLora(
        self, request: worker_pb2.LoadLoraRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoraState:
        self.started.set()
        await asyncio.sleep(0.5)
        return worker_pb2.LoraState(num_loads=7)

    @rpc_handler
    async def UnloadLora(
        self, request: worker_pb2.UnloadLoraRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoraState:
        raise InvalidArgument("role is not valid here", param="role")


async def _health(stub: health_pb2_grpc.HealthStub) -> int:
    return int((await stub.Check(health_pb2.HealthCheckRequest(service=""))).status)


async def test_health_errors_and_drain() -> None:
    server = GrpcServer("demo", ServerConfig(port=0, drain_timeout_s=5))
    servicer = SlowWorker()
    server.add_service("meshserve.v1.Worker", worker_pb2_grpc.add_WorkerServicer_to_server, servicer)
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        worker = worker_pb2_grpc.WorkerStub(channel)
        assert await _health(health) == health_pb2.HealthCheckResponse.NOT_SERVING
        await server.set_serving(True)
        assert await _health(health) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await worker.UnloadLora(worker_pb2.UnloadLoraRequest(name="a"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "role" in (bad.value.details() or "")
        assert error_from_rpc(bad.value).param == "role"
        # Bytes that do not parse as the request message: INVALID_ARGUMENT, not UNKNOWN.
        raw = channel.unary_unary(
            "/meshserve.v1.Worker/Embed", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        with pytest.raises(grpc.aio.AioRpcError) as malformed:
            await raw(b"\x0a\x02\x80\x80")  # field 1 (string) holding invalid UTF-8
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request" in (malformed.value.details() or "")
        in_flight = asyncio.ensure_future(worker.LoadLora(worker_pb2.LoadLoraRequest(name="a")))
        await servicer.started.wait()
        drained = asyncio.create_task(server.drain_and_stop())
        # The call in flight finishes during the drain ...
        assert (await in_flight).num_loads == 7
        await drained
    # ... and the stopped server refuses new calls.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker_pb2_grpc.WorkerStub(channel).LoadLora(
                worker_pb2.LoadLoraRequest(name="a"), timeout=2
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


_SETTLE_SCRIPT = """
import asyncio, gc
from services.config import ServerConfig
from services.server import GrpcServer

async def main():
    server = GrpcServer("probe", ServerConfig(host="127.0.0.1", port=0))
    await server.start()
    before = (gc.get_threshold()[0], gc.get_freeze_count())
    await server.set_serving(True)
    after = (gc.get_threshold()[0], gc.get_freeze_count())
    await server.server.stop(None)
    print(before[0], before[1], after[0], after[1])

asyncio.run(main())
"""


def test_serving_settles_the_heap_once_start_up_is_over() -> None:
    """A service that reports SERVING freezes what start-up left alive and makes young
    collections rarer (services/gc_tuning.py); before that the defaults hold. In a
    fresh interpreter: the freeze is process-wide."""
    import subprocess
    import sys

    from services.gc_tuning import GEN0_THRESHOLD

    out = subprocess.run(
        [sys.executable, "-c", _SETTLE_SCRIPT], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    threshold_before, frozen_before, threshold_after, frozen_after = map(int, out)
    assert threshold_before == 700 and frozen_before == 0
    assert threshold_after == GEN0_THRESHOLD
    assert frozen_after > 10_000  # grpc, protobuf, the servicers: all of start-up


async def test_a_second_server_on_a_served_port_fails_to_start() -> None:
    """gRPC's default SO_REUSEPORT would let it bind and take half the first one's connections."""
    first = GrpcServer("first", ServerConfig(host="127.0.0.1", port=0))
    port = await first.start()
    second = GrpcServer("second", ServerConfig(host="127.0.0.1", port=port))
    try:
        with pytest.raises(RuntimeError, match=str(port)):
            await second.start()
    finally:
        await second.server.stop(None)
        await first.server.stop(None)
