"""Graceful shutdown under load: SIGTERM to the gateway and to a decoder worker while
streams run. In-flight requests finish normally, new ones are refused (HTTP 503 /
gRPC UNAVAILABLE), and the process exits within its drain grace period."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import httpx
import pytest

from meshserve.v1 import common_pb2, worker_pb2_grpc
from tests.mesh import (
    DRAIN_TIMEOUT_S,
    MODEL_NAME,
    RunningMesh,
    StreamResult,
    chat_body,
    report,
    stream_chat,
    wait_gateway_healthy,
)
from tests.worker_svc.worker_kit import RequestFailed, generate_one

pytestmark = pytest.mark.slow
T = TypeVar("T")

STREAMS = 12
TOKENS = 160
# uvicorn's final grace after the drain (gateway/__main__.py FINAL_GRACE_S) plus slack.
EXIT_SLACK_S = 8.0


async def _during_streams(mesh: RunningMesh, action: Callable[[], T]) -> tuple[list[StreamResult], T]:
    """Runs STREAMS long streams; once each produced a chunk, runs `action()` in a thread
    (its return value is passed back) while the streams continue."""
    firsts = [asyncio.Event() for _ in range(STREAMS)]
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [
            asyncio.create_task(
                stream_chat(
                    client,
                    mesh.gateway_url,
                    chat_body(f"drain {i} " * (1 + i % 4), max_tokens=TOKENS, ignore_eos=True),
                    on_first_chunk=firsts[i],
                )
            )
            for i in range(STREAMS)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        outcome = await asyncio.to_thread(action)
        results = await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_TIMEOUT_S + 30)
    return list(results), outcome


def test_sigterm_gateway_under_load(mesh: RunningMesh) -> None:
    """In-flight streams complete; a new request after SIGTERM is 503 'draining'; the
    gateway exits (code 0) within drain_timeout_s; a restarted gateway serves again."""
    mesh.wait_kv_idle()
    timing: dict[str, float] = {}

    def sigterm_then_probe() -> httpx.Response:
        mesh.kill("gateway", signal.SIGTERM)
        timing["signal"] = time.monotonic()
        time.sleep(0.3)
        return httpx.post(mesh.gateway_url + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=10)

    results, probe = asyncio.run(_during_streams(mesh, sigterm_then_probe))
    code = mesh.wait_exit("gateway", DRAIN_TIMEOUT_S + EXIT_SLACK_S)
    exit_s = time.monotonic() - timing["signal"]
    failed = [r for r in results if not r.ok]
    report(
        f"SIGTERM gateway: {STREAMS - len(failed)}/{STREAMS} in-flight streams completed "
        f"({min(r.chunks for r in results)}-{max(r.chunks for r in results)} chunks); new request -> "
        f"{probe.status_code}; exited (code {code}) {exit_s:.1f}s after the signal"
    )
    assert not failed, failed[:3]
    assert all(r.finish_reason == "length" for r in results)
    assert probe.status_code == 503, probe.text
    assert probe.json()["error"]["code"] == "draining"
    assert code == 0, mesh.log_tail("gateway")
    mesh.restart("gateway")
    wait_gateway_healthy(mesh.gateway_url)
    mesh.wait_kv_idle()


def test_sigterm_worker_under_load(mesh: RunningMesh) -> None:
    """SIGTERM the busiest decoder: its in-flight streams complete, a request sent to it
    directly (on a GenerateStream of its own) is refused with UNAVAILABLE, new requests through the gateway are served by the
    other worker, and it exits within its drain grace; then it is restarted."""
    mesh.wait_kv_idle()
    timing: dict[str, float] = {}
    victim: list[str] = []

    def sigterm_then_probe() -> tuple[grpc.StatusCode | None, int]:
        name = max(mesh.decoders, key=lambda n: mesh.worker_load(n).num_running)
        victim.append(name)
        mesh.kill(name, signal.SIGTERM)
        timing["signal"] = time.monotonic()
        time.sleep(0.5)
        direct = asyncio.run(_direct_generate(mesh.address(name)))
        reply = httpx.post(
            mesh.gateway_url + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30
        )
        return direct, reply.status_code

    results, (direct, via_gateway) = asyncio.run(_during_streams(mesh, sigterm_then_probe))
    name = victim[0]
    code = mesh.wait_exit(name, DRAIN_TIMEOUT_S + EXIT_SLACK_S)
    exit_s = time.monotonic() - timing["signal"]
    failed = [r for r in results if not r.ok]
    report(
        f"SIGTERM {name}: {STREAMS - len(failed)}/{STREAMS} in-flight streams completed; direct request -> "
        f"{direct.name if direct else 'OK'}; new gateway request -> {via_gateway}; exited (code {code}) "
        f"{exit_s:.1f}s after the signal"
    )
    assert not failed, failed[:3]
    assert direct is grpc.StatusCode.UNAVAILABLE
    assert via_gateway == 200
    assert code == 0, mesh.log_tail(name)
    mesh.restart(name)
    mesh.wait_registered(name)
    mesh.wait_kv_idle()


async def _direct_generate(address: str) -> grpc.StatusCode | None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = common_pb2.GenerateRequest(
            request_id="after-sigterm",
            model=MODEL_NAME,
            prompt_token_ids=[1, 2, 3],
            sampling=common_pb2.SamplingParams(max_tokens=2),
        )
        try:
            async for _ in generate_one(stub, request, timeout=10):
                pass
        except (grpc.aio.AioRpcError, RequestFailed) as exc:
            return exc.code()
    return None
