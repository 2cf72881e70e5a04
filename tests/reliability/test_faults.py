"""Fault injection on the real mesh: kill -9 a decoder worker mid-stream (its streams
migrate), kill one or both scheduler replicas, stop Redis, stop the encoder cache.

For each: no hang (every client gets its tokens or a clear error within a bound), the
mesh recovers (new requests succeed; recovery time measured), and no KV blocks leak on
the surviving workers (kv_usage 0, every block free once idle).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import httpx
import pytest

from meshserve.v1 import encoder_cache_pb2, encoder_cache_pb2_grpc
from services.rpc import channel_options
from tests.mesh import (
    RunningMesh,
    StreamResult,
    chat_body,
    metric_value,
    report,
    stream_chat,
    wait_gateway_healthy,
)

pytestmark = pytest.mark.slow

T = TypeVar("T")

# Every client must have its answer (tokens or an error) within this many seconds.
CLIENT_BOUND_S = 60.0
STREAMS = 12
LONG_TOKENS = 400
# Redis stays down at least this long (several scheduler housekeeping and heartbeat rounds).
REDIS_OUTAGE_S = 6.0


def _long_body(i: int) -> dict[str, object]:
    return chat_body(f"fault stream {i} " * (1 + i % 3), max_tokens=LONG_TOKENS, ignore_eos=True)


async def _streams_then(
    mesh: RunningMesh,
    fault: Callable[[], None],
    n: int = STREAMS,
    probe: bool = False,
    body: Callable[[int], dict[str, object]] = _long_body,
) -> tuple[list[StreamResult], float, float]:
    """Starts `n` long streams, waits until each produced a chunk, runs `fault()`, then
    collects every stream (bounded). With `probe`, new requests are sent right after the
    fault, concurrently, until one succeeds. Returns the results, the fault time and the
    seconds from the fault to that first success (NaN without `probe`)."""
    firsts = [asyncio.Event() for _ in range(n)]
    async with httpx.AsyncClient(timeout=CLIENT_BOUND_S) as client:
        tasks = [
            asyncio.create_task(stream_chat(client, mesh.gateway_url, body(i), on_first_chunk=firsts[i]))
            for i in range(n)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        fault_at = time.monotonic()
        await asyncio.to_thread(fault)
        prober = (
            asyncio.create_task(asyncio.to_thread(_first_success_after, mesh, fault_at)) if probe else None
        )
        _done, pending = await asyncio.wait(tasks, timeout=CLIENT_BOUND_S)
        for task in pending:
            task.cancel()
        assert not pending, f"{len(pending)} clients hung for more than {CLIENT_BOUND_S}s after the fault"
        probe_s = await prober if prober is not None else math.nan
        return [t.result() for t in tasks], fault_at, probe_s  # in request order


def _first_success_after(
    mesh: RunningMesh, start: float, timeout: float = 60.0, url: str | None = None
) -> float:
    """Sends small requests until one succeeds; seconds from `start` to that success.
    Every failed attempt must itself fail fast with an error status (no hang)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            attempt = time.monotonic()
            reply = httpx.post(
                (url or mesh.gateway_url) + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30
            )
            if reply.status_code == 200:
                return time.monotonic() - start
            assert reply.status_code in (429, 500, 502, 503, 504), reply.text
            assert reply.json()["error"]["message"]
            assert time.monotonic() - attempt < 30
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no successful request within {timeout:.0f}s")
        time.sleep(0.1)


def _busiest_decoder(mesh: RunningMesh) -> str:
    return max(mesh.decoders, key=lambda n: mesh.worker_load(n).num_running)


def _summary(results: list[StreamResult], fault_at: float) -> str:
    ok = sum(r.ok for r in results)
    failed = [r for r in results if not r.ok]
    worst = max((r.seconds for r in results), default=0.0)
    kinds = sorted({(r.error or "")[:80] for r in failed})
    return f"{ok}/{len(results)} completed, {len(failed)} clear errors {kinds}, slowest client {worst:.1f}s"


def _reproducible_body(i: int) -> dict[str, object]:
    """Stream `i` of the migration test: greedy or seeded, so its text is reproducible."""
    sampling = {"temperature": 0.0} if i % 2 else {"temperature": 1.0, "seed": 1000 + i}
    return chat_body(f"fault stream {i} " * (1 + i % 3), max_tokens=LONG_TOKENS, ignore_eos=True, **sampling)


async def _reference_texts(mesh: RunningMesh, n: int) -> list[str]:
    async with httpx.AsyncClient(timeout=CLIENT_BOUND_S) as client:
        results = await asyncio.gather(
            *(stream_chat(client, mesh.gateway_url, _reproducible_body(i)) for i in range(n))
        )
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return [r.text for r in results]


@dataclass
class _DecoderFaultRun:
    """Reproducible streams with a fault on the busiest decoder (see `_decoder_fault_run`)."""

    results: list[StreamResult]
    fault_at: float
    victim: str
    migrated: int
    probe_s: float

    def assert_seamless(self, reference: list[str]) -> None:
        """Every stream completed, no error, each text equal to its uninterrupted run."""
        assert self.migrated >= 1, "no stream ran on the faulted worker: the test proved nothing"
        assert all(r.ok for r in self.results), _summary(self.results, self.fault_at)
        for i, result in enumerate(self.results):
            assert result.text == reference[i], f"stream {i} differs from its uninterrupted run"
            assert result.completion_tokens == LONG_TOKENS, result


def _decoder_fault_run(
    mesh: RunningMesh, fault: Callable[[str], None], probe: bool = False
) -> tuple[_DecoderFaultRun, list[str]]:
    """Runs the reproducible streams once undisturbed (the reference texts), then again
    with `fault(victim)` applied to the busiest decoder once every stream has output."""
    mesh.wait_kv_idle()
    for name in mesh.decoders:
        mesh.wait_registered(name)
    reference = asyncio.run(_reference_texts(mesh, STREAMS))
    before = _migrations(mesh)
    victim: list[str] = []

    def on_fault() -> None:
        victim.append(_busiest_decoder(mesh))
        fault(victim[0])

    results, fault_at, probe_s = asyncio.run(
        _streams_then(mesh, on_fault, body=_reproducible_body, probe=probe)
    )
    run = _DecoderFaultRun(results, fault_at, victim[0], _migrations(mesh) - before, probe_s)
    return run, reference


def test_kill9_worker_mid_stream_migrates(mesh: RunningMesh) -> None:
    """SIGKILL the busiest decoder while streams run on it: every stream on it migrates
    to the survivor (prompt + tokens so far) and completes -- no error, and for greedy and
    seeded requests exactly the text of an uninterrupted run; usage counts every token
    once; the survivor frees all its KV; the restarted worker registers and serves again."""
    run, reference = _decoder_fault_run(mesh, lambda victim: mesh.kill(victim, signal.SIGKILL), probe=True)
    run.assert_seamless(reference)
    survivors = [n for n in mesh.decoders if n != run.victim]
    mesh.wait_kv_idle(timeout=20, names=survivors)
    restart_s = mesh.restart(run.victim)
    registered_s = mesh.wait_registered(run.victim)
    mesh.wait_kv_idle()
    report(
        f"kill -9 {run.victim}: {_summary(run.results, run.fault_at)}, {run.migrated} migrated, every text "
        f"equal to an uninterrupted run; new request served {run.probe_s:.2f}s after the kill; restart "
        f"healthy in {restart_s:.1f}s (+{registered_s:.1f}s to register); survivor KV idle"
    )


def _migrations(mesh: RunningMesh) -> int:
    """How many times the gateway has moved a stream to another worker mid-stream (its
    metric, checked against its log so both must reflect it)."""
    port = int(mesh.gateway_url.rsplit(":", 1)[1])
    counted = int(metric_value(port, "meshserve_gateway_migrations_total", outcome="migrated"))
    assert counted == mesh.log_tail("gateway", lines=100_000).count("; migrating ("), (
        "metric and log disagree"
    )
    return counted


def _reset_connections_to(port: int) -> bool:
    """Resets every TCP connection to 127.0.0.1:`port` (`ss -K`, both processes stay up);
    False where the kernel or the tool cannot (then the fault cannot be produced)."""
    if shutil.which("ss") is None:
        return False
    result = subprocess.run(
        ["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.returncode == 0 and f":{port}" in result.stdout


def test_upstream_connection_reset_migrates(mesh: RunningMesh) -> None:
    """The gateway's connections to a decoder (its gRPC port: the GenerateStream) are
    reset while both stay up (a network fault): the gateway's streams on it migrate and
    complete with the text of an uninterrupted run; the decoder sees its client gone
    and frees their KV."""
    reset: list[bool] = []

    def on_fault(victim: str) -> None:
        reset.append(_reset_connections_to(int(mesh.address(victim).rsplit(":", 1)[1])))

    run, reference = _decoder_fault_run(mesh, on_fault)
    if not reset[0]:
        pytest.skip("cannot reset TCP connections here (ss -K unsupported)")
    run.assert_seamless(reference)
    mesh.wait_kv_idle(timeout=20)
    report(
        f"connection reset gateway -> {run.victim}: {_summary(run.results, run.fault_at)}, "
        f"{run.migrated} migrated, texts equal to an uninterrupted run; KV idle"
    )


def test_worker_death_before_first_token_is_retried_elsewhere(mesh: RunningMesh) -> None:
    """SIGKILL a decoder, then at once (before the scheduler has missed its heartbeats)
    send requests: those routed to the dead worker fail to reach it before any token and
    are routed again, excluding it, so every client gets its answer."""
    mesh.wait_kv_idle()
    for name in mesh.decoders:  # the other decoder must really serve (a previous test restarts)
        mesh.wait_registered(name)
    assert _first_success_after(mesh, time.monotonic()) < 30
    # The victim is the worker that served a request with the burst's prefix: prefix-aware
    # routing sends the burst there (the scheduler has not yet missed its heartbeats).
    finished = {name: mesh.worker_load(name).num_finished for name in mesh.decoders}
    warm = httpx.post(
        mesh.gateway_url + "/v1/chat/completions", json=chat_body("retry warm-up", max_tokens=4), timeout=30
    )
    assert warm.status_code == 200, warm.text
    victim = max(mesh.decoders, key=lambda name: mesh.worker_load(name).num_finished - finished[name])
    before = _reroutes(mesh)
    mesh.kill(victim)
    try:
        assert mesh.wait_exit(victim, 10) is not None
        statuses, retried = _burst_after_kill(mesh, before)
    finally:
        restart_s = mesh.restart(victim)
        mesh.wait_registered(victim)
    assert statuses == [200] * 12, statuses
    assert retried >= 1, "no request was routed to the dead worker: the test proved nothing"
    report(
        f"kill -9 {victim}, then 12 requests: all served, {retried} routed again; restart {restart_s:.1f}s"
    )


def _burst_after_kill(mesh: RunningMesh, reroutes_before: int) -> tuple[list[int], int]:
    """12 concurrent requests sharing the warm-up's prefix: their statuses, and how many
    times the gateway routed a request again since `reroutes_before`."""

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=CLIENT_BOUND_S) as client:
            replies = await asyncio.gather(
                *(
                    client.post(
                        mesh.gateway_url + "/v1/chat/completions", json=chat_body(f"retry {i}", max_tokens=4)
                    )
                    for i in range(12)
                )
            )
        return [r.status_code for r in replies]

    statuses = asyncio.run(burst())
    return statuses, _reroutes(mesh) - reroutes_before


SCHEDULERS = ("scheduler", "scheduler-1")


def _reroutes(mesh: RunningMesh) -> int:
    """How many times the gateway has routed a request again after a worker failure."""
    return mesh.log_tail("gateway", lines=100_000).count("routing again")


def test_kill9_one_scheduler_replica_loses_nothing(mesh: RunningMesh) -> None:
    """SIGKILL one of the two scheduler replicas while 32 streams run: the streams do not
    pass through it, so all 32 complete; new requests keep being routed (by the other
    replica) right away; the restarted replica serves again."""
    mesh.wait_kv_idle()
    results, fault_at, first_s = asyncio.run(
        _streams_then(mesh, lambda: mesh.kill("scheduler-1"), n=32, probe=True)
    )
    assert mesh.wait_exit("scheduler-1", 10) is not None
    failed = [r for r in results if not r.ok]
    assert not failed, _summary(results, fault_at)
    served = [_first_success_after(mesh, time.monotonic()) for _ in range(8)]
    restart_s = mesh.restart("scheduler-1")
    mesh.wait_kv_idle()
    report(
        f"kill -9 scheduler-1 (of 2): {_summary(results, fault_at)}; first new request served "
        f"{first_s:.2f}s after the kill, 8 more in {sum(served):.2f}s; restart healthy in {restart_s:.1f}s"
    )


def test_kill9_every_scheduler_then_restart(mesh: RunningMesh) -> None:
    """SIGKILL every scheduler replica mid-stream: the streams in flight all complete (the
    scheduler is not in the token path); new requests get a clear 503 naming the
    scheduler until one is back; then requests succeed and no KV block leaks."""
    mesh.wait_kv_idle()

    def kill_all() -> None:
        for name in SCHEDULERS:
            mesh.kill(name)

    results, fault_at, _ = asyncio.run(_streams_then(mesh, kill_all))
    for name in SCHEDULERS:
        assert mesh.wait_exit(name, 10) is not None
    assert all(r.ok for r in results), _summary(results, fault_at)
    outage_start = time.monotonic()
    reply = httpx.post(mesh.gateway_url + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30)
    refuse_s = time.monotonic() - outage_start
    assert reply.status_code == 503, reply.text
    assert "scheduler" in reply.json()["error"]["message"]
    assert refuse_s < 10
    assert httpx.get(mesh.gateway_url + "/health", timeout=10).status_code == 503
    mesh.wait_kv_idle(timeout=20)
    restart_at = time.monotonic()
    mesh.start_service(mesh.specs["scheduler-1"])  # restart() waits for every service
    mesh.restart("scheduler")
    for name in mesh.decoders:
        mesh.wait_registered(name)
    recovered_s = _first_success_after(mesh, restart_at)
    wait_gateway_healthy(mesh.gateway_url)
    mesh.wait_kv_idle()
    report(
        f"kill -9 both schedulers: {_summary(results, fault_at)}; request during outage 503 in "
        f"{refuse_s:.2f}s; first success {recovered_s:.1f}s after the restart began"
    )


def test_kill9_tokenizer_mid_stream(mesh: RunningMesh) -> None:
    """SIGKILL the tokenizer service mid-stream: it renders prompts but is not in the token
    path (the gateway detokenizes with the files it fetched at start), so every stream in
    flight completes; new requests get a clear 503 naming the tokenizer until it is back."""
    mesh.wait_kv_idle()
    results, fault_at, _ = asyncio.run(_streams_then(mesh, lambda: mesh.kill("tokenizer")))
    assert mesh.wait_exit("tokenizer", 10) is not None
    assert all(r.ok for r in results), _summary(results, fault_at)
    reply = httpx.post(mesh.gateway_url + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30)
    assert reply.status_code == 503, reply.text
    assert "tokenizer" in reply.json()["error"]["message"]
    restart_at = time.monotonic()
    mesh.restart("tokenizer")
    recovered_s = _first_success_after(mesh, restart_at)
    mesh.wait_kv_idle()
    report(
        f"kill -9 tokenizer: {_summary(results, fault_at)}; request during the outage 503; "
        f"first success {recovered_s:.1f}s after the restart began"
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_redis_stop_and_restart(mesh: RunningMesh, sig: signal.Signals) -> None:
    """Redis is optional shared state: while it is down (stopped or killed) requests still
    succeed (or fail fast and clearly); after it is back everything works, no KV leaks."""
    redis = mesh.redis
    assert redis is not None and redis.pid is not None
    mesh.wait_kv_idle()
    stop_at = time.monotonic()
    os.kill(redis.pid, sig)
    redis.stop()  # reaps it
    codes: list[int] = []
    slowest = 0.0
    i = 0
    while i < 10 or time.monotonic() - stop_at < REDIS_OUTAGE_S:
        i += 1
        start = time.monotonic()
        reply = httpx.post(
            mesh.gateway_url + "/v1/chat/completions",
            json=chat_body(f"redis down {i}", max_tokens=4),
            timeout=30,
        )
        slowest = max(slowest, time.monotonic() - start)
        codes.append(reply.status_code)
        if reply.status_code != 200:
            assert reply.json()["error"]["message"]
    outage_s = time.monotonic() - stop_at
    redis.start()
    restart_at = time.monotonic()
    recovered_s = _first_success_after(mesh, restart_at)
    # The scheduler's KV subscriber and registry mirror reconnect; prefix routing resumes.
    time.sleep(2.0)
    results = [
        httpx.post(
            mesh.gateway_url + "/v1/chat/completions",
            json=chat_body(f"redis back {i}", max_tokens=4),
            timeout=30,
        ).status_code
        for i in range(5)
    ]
    mesh.wait_kv_idle()
    report(
        f"Redis {sig.name}, down {outage_s:.1f}s: {codes.count(200)}/{len(codes)} requests served during the outage "
        f"(slowest {slowest:.2f}s); after restart first success in {recovered_s:.2f}s, {results.count(200)}/5 ok"
    )
    assert codes.count(200) == len(codes), codes
    assert results.count(200) == len(results), results


async def _cache_call(address: str, put: bool) -> bool:
    # A local subchannel pool: grpc shares subchannels across channels of a process, so
    # the refused connection of the "cache is down" call would otherwise still be in
    # reconnect backoff when the restarted cache is called.
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = encoder_cache_pb2_grpc.EncoderCacheStub(channel)
        if put:

            async def chunks() -> AsyncIterator[encoder_cache_pb2.TensorChunk]:
                meta = encoder_cache_pb2.TensorMeta(
                    identifier="img-1", dtype="float32", shape=[4], num_bytes=16
                )
                yield encoder_cache_pb2.TensorChunk(meta=meta, data=b"\0" * 16)

            await stub.Put(chunks(), timeout=5)
        reply = await stub.Has(encoder_cache_pb2.HasRequest(identifiers=["img-1"]), timeout=5)
        return bool(reply.present[0])


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP], ids=["sigterm", "kill-9", "sigstop"]
)
def test_encoder_cache_lost(mesh: RunningMesh, sig: signal.Signals) -> None:
    """The encoder cache stopped (SIGTERM: exit 0), killed or hung: its clients get a
    clear error fast (UNAVAILABLE; for a hung one after the 5 s connect timeout), text
    generation is unaffected (nothing on the text path depends on it), and a restarted
    cache serves again (empty: it is in memory) -- a resumed one still holds its items."""
    address = mesh.address("encoder-cache")
    assert asyncio.run(_cache_call(address, put=True))
    mesh.kill("encoder-cache", sig)
    code = mesh.wait_exit("encoder-cache", 30) if sig != signal.SIGSTOP else None
    try:
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(_cache_call(address, put=False))
        refused_s = time.monotonic() - start
        reply = httpx.post(
            mesh.gateway_url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=30
        )
    finally:
        if sig == signal.SIGSTOP:
            mesh.kill("encoder-cache", signal.SIGCONT)
    assert reply.status_code == 200, reply.text
    # A hung cache: the connect timeout (no HTTP/2 SETTINGS) or the call's deadline.
    hung = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert info.value.code() in (hung if sig == signal.SIGSTOP else (grpc.StatusCode.UNAVAILABLE,))
    expected = info.value.code()
    assert refused_s < 8  # the call deadline is 5 s
    restart_s = mesh.restart("encoder-cache") if sig != signal.SIGSTOP else 0.0
    present = asyncio.run(_cache_call(address, put=False))
    report(
        f"encoder cache {sig.name}: exit code {code}; client refused ({expected.name}) in {refused_s:.2f}s; "
        f"text generation unaffected; back in {restart_s:.1f}s, previous item present: {present}"
    )
    if sig == signal.SIGTERM:
        assert code == 0
    assert present == (sig == signal.SIGSTOP)


# --------------------------------------------------------------- hung, not dead (SIGSTOP)

# A stopped peer keeps its TCP connections open: only gRPC keepalive (a worker's streams:
# a ping every 0.5 s, 1 s to answer; other channels: every 10 s, 5 s) or a connect
# timeout notices. Every client must still be answered
# within this bound.
HUNG_BOUND_S = 45.0


def _hang(mesh: RunningMesh, name: str) -> None:
    mesh.kill(name, signal.SIGSTOP)


def _resume(mesh: RunningMesh, name: str) -> None:
    mesh.kill(name, signal.SIGCONT)


def _timed_post(mesh: RunningMesh, body: dict[str, object]) -> tuple[int, str, float]:
    """(status, error message or "", seconds) of one chat completion."""
    start = time.monotonic()
    reply = httpx.post(mesh.gateway_url + "/v1/chat/completions", json=body, timeout=HUNG_BOUND_S + 15)
    message = "" if reply.status_code == 200 else str(reply.json()["error"]["message"])
    return reply.status_code, message, time.monotonic() - start


def test_sigstop_decoder_mid_stream_migrates(mesh: RunningMesh) -> None:
    """SIGSTOP the busiest decoder while streams run on it: the gateway's keepalive finds
    the stream dead, the streams migrate and complete with exactly the text of an
    uninterrupted run; the scheduler stops routing to it (missed heartbeats). After
    SIGCONT the worker aborts the orphaned requests (KV idle) and serves again."""
    try:
        run, reference = _decoder_fault_run(mesh, lambda victim: _hang(mesh, victim))
        unlisted = _unlisted_within(mesh, run.victim, 10.0)  # the streams may move first
    finally:
        for name in mesh.decoders:  # harmless for a running one
            _resume(mesh, name)
    run.assert_seamless(reference)
    assert unlisted, "the scheduler still listed the hung worker as healthy"
    mesh.wait_kv_idle(timeout=30)
    registered_s = mesh.wait_registered(run.victim)
    report(
        f"SIGSTOP {run.victim}: {_summary(run.results, run.fault_at)}, {run.migrated} migrated, texts equal "
        f"to an uninterrupted run; after SIGCONT KV idle, registered again in {registered_s:.1f}s"
    )


def _unlisted_within(mesh: RunningMesh, name: str, timeout: float) -> bool:
    """Whether the scheduler stops listing ``name`` as healthy within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while name in mesh.healthy_decoders():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _while_hung(mesh: RunningMesh, names: list[str], during: Callable[[], T]) -> tuple[str, T, float]:
    """Streams in flight, SIGSTOP `names`, `during()` while they hang, SIGCONT. Every
    stream in flight must complete. Returns the streams' summary, what `during` gave
    and the seconds from SIGCONT to the next successful request (KV idle after)."""
    mesh.wait_kv_idle()
    try:
        results, fault_at, _ = asyncio.run(_streams_then(mesh, lambda: [_hang(mesh, n) for n in names]))
        value = during()
    finally:
        for name in names:
            _resume(mesh, name)
    assert all(r.ok for r in results), _summary(results, fault_at)
    recovered_s = _first_success_after(mesh, time.monotonic())
    mesh.wait_kv_idle()
    return _summary(results, fault_at), value, recovered_s


def test_sigstop_one_scheduler_replica(mesh: RunningMesh) -> None:
    """SIGSTOP one of two scheduler replicas: streams in flight complete; new requests are
    served through the other replica (a Route stuck on the hung one fails over once
    keepalive or the connect timeout gives up on it), each within the bound."""
    summary, probes, recovered_s = _while_hung(
        mesh,
        ["scheduler-1"],
        lambda: [_timed_post(mesh, chat_body(f"one replica hung {i}", max_tokens=2)) for i in range(6)],
    )
    assert [p[0] for p in probes] == [200] * len(probes), probes
    slowest = max(p[2] for p in probes)
    assert slowest < HUNG_BOUND_S, probes
    report(
        f"SIGSTOP scheduler-1: {summary}; 6/6 new requests served, slowest {slowest:.1f}s; "
        f"after SIGCONT first success in {recovered_s:.2f}s"
    )


def test_sigstop_every_scheduler(mesh: RunningMesh) -> None:
    """SIGSTOP both scheduler replicas: streams in flight complete (not in the token path);
    a new request gets a clear 503 naming the scheduler within the bound (no hang),
    /health says 503; after SIGCONT requests are served again."""

    def during() -> tuple[tuple[int, str, float], int]:
        probe = _timed_post(mesh, chat_body("all schedulers hung", max_tokens=2))
        return probe, httpx.get(mesh.gateway_url + "/health", timeout=30).status_code

    summary, ((status, message, refuse_s), health), recovered_s = _while_hung(mesh, list(SCHEDULERS), during)
    assert status == 503 and "scheduler" in message, (status, message)
    assert refuse_s < HUNG_BOUND_S
    assert health == 503
    report(
        f"SIGSTOP both schedulers: {summary}; new request 503 naming the scheduler in {refuse_s:.1f}s; "
        f"/health 503; after SIGCONT first success in {recovered_s:.2f}s"
    )


def test_sigstop_tokenizer(mesh: RunningMesh) -> None:
    """SIGSTOP the tokenizer: streams in flight complete (the gateway detokenizes);
    a new request gets a clear 503 naming the tokenizer within the bound; after SIGCONT
    requests are served again."""
    summary, (status, message, refuse_s), recovered_s = _while_hung(
        mesh, ["tokenizer"], lambda: _timed_post(mesh, chat_body("tokenizer hung", max_tokens=2))
    )
    assert status == 503 and "tokenizer" in message, (status, message)
    assert refuse_s < HUNG_BOUND_S
    report(
        f"SIGSTOP tokenizer: {summary}; new request 503 naming the tokenizer in {refuse_s:.1f}s; "
        f"after SIGCONT first success in {recovered_s:.2f}s"
    )


def test_sigstop_redis(mesh: RunningMesh) -> None:
    """SIGSTOP Redis (hung, connections open): streams in flight complete and new requests
    are served or refused clearly within the bound; after SIGCONT everything is served."""
    redis = mesh.redis
    assert redis is not None and redis.pid is not None
    mesh.wait_kv_idle()
    pid = redis.pid
    try:
        results, fault_at, _ = asyncio.run(_streams_then(mesh, lambda: os.kill(pid, signal.SIGSTOP)))
        probes = [_timed_post(mesh, chat_body(f"redis hung {i}", max_tokens=2)) for i in range(6)]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert all(r.ok for r in results), _summary(results, fault_at)
    slowest = max(p[2] for p in probes)
    assert slowest < HUNG_BOUND_S, probes
    assert all(code == 200 or message for code, message, _ in probes), probes
    recovered_s = _first_success_after(mesh, time.monotonic())
    mesh.wait_kv_idle()
    served = sum(code == 200 for code, _, _ in probes)
    report(
        f"SIGSTOP Redis: {_summary(results, fault_at)}; {served}/6 new requests served during it (slowest "
        f"{slowest:.2f}s); after SIGCONT first success in {recovered_s:.2f}s"
    )
    assert served == len(probes), probes
