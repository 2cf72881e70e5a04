"""Client disconnects abort the request on the worker stream and release its lease;
draining answers 503; SIGTERM on `python -m gateway` lets streams finish."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from gateway_fakes import MODEL, Harness, wait_for

from services.ports import free_port

CHAT = "/v1/chat/completions"
SLOW = [{"role": "user", "content": "SLOW"}]


def assert_aborted_and_released(harness: Harness, request_id: str) -> None:
    """The worker saw the abort (the request did not run to its end) and the scheduler
    got the lease back."""
    assert wait_for(lambda: request_id in harness.worker.aborted), "abort never reached the worker"
    assert wait_for(lambda: request_id in harness.worker.cancelled)
    assert request_id not in harness.worker.completed
    leases = harness.scheduler.leases_of(request_id)
    assert leases and wait_for(lambda: set(leases) <= set(harness.scheduler.released)), "lease not released"


def test_stream_disconnect_cancels_upstream(http: httpx.Client, harness: Harness) -> None:
    with http.stream("POST", CHAT, json={"model": MODEL, "messages": SLOW, "stream": True}) as reply:
        lines = reply.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first.removeprefix("data: "))["id"]
        next(lines)
    # Closing the response dropped the connection: the request must be aborted.
    assert_aborted_and_released(harness, request_id)


def test_non_stream_disconnect_cancels_upstream(gw_url: str, harness: Harness) -> None:
    before = set(harness.worker.request_ids())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw_url + CHAT, json={"model": MODEL, "messages": SLOW}, timeout=0.5)
    new = [r for r in harness.worker.request_ids() if r not in before]
    assert len(new) == 1
    assert_aborted_and_released(harness, new[0])


def test_drain_refuses_new_requests(harness: Harness) -> None:
    """Repeated on fresh keep-alive connections: the 503 must reach the client every time
    (an unread request body used to turn it into a connection reset now and then)."""
    gw = harness.start_gateway(harness.config())
    state = gw.app.state.gateway
    try:
        for _ in range(20):
            state.draining = False
            with httpx.Client(base_url=gw.url, timeout=10) as http:
                assert http.get("/v1/models").status_code == 200
                state.start_drain()
                reply = http.post(CHAT, json={"model": MODEL, "messages": SLOW})
                assert reply.status_code == 503
                assert reply.json()["error"]["code"] == "draining"
                health = http.get("/health")
                assert health.status_code == 503 and health.json()["components"]["gateway"] == "draining"
    finally:
        harness.stop_gateway(gw)


def _read_stream(url: str, out: list[str]) -> None:
    body = {"model": MODEL, "messages": SLOW, "stream": True, "max_tokens": 40}
    with httpx.stream("POST", url + CHAT, json=body, timeout=20) as reply:
        out.extend(line for line in reply.iter_lines() if line.startswith("data: "))


def test_sigterm_drains_then_exits(harness: Harness, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "--port",
        str(port),
        "--tokenizer-address",
        harness.tok_server.address,
        "--scheduler-address",
        harness.sched_server.address,
        "--drain-timeout-s",
        "10",
        "--tokenizer-cache-dir",
        str(tmp_path / "tokenizers"),
        "--log-level",
        "WARNING",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", *args], env=env)
    try:
        # Start-up imports transformers (the in-process tokenizer): 15-20 s on a loaded box.
        assert wait_for(lambda: _healthy(url), timeout=90), "gateway did not start"
        events: list[str] = []
        reader = threading.Thread(target=_read_stream, args=(url, events))
        reader.start()
        assert wait_for(lambda: len(events) > 2)
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: _status(url) == 503, timeout=3)  # still listening, refusing
        reader.join(15)
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"
        assert proc.wait(10) == 0
        # The stream ran to its end on the worker, and its lease went back on the way out.
        assert last["id"] in harness.worker.completed
        leases = harness.scheduler.leases_of(last["id"])
        assert leases and set(leases) <= set(harness.scheduler.released)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _status(url: str) -> int:
    try:
        return httpx.post(url + CHAT, json={"model": MODEL, "messages": SLOW}, timeout=5).status_code
    except httpx.TransportError:
        return -1


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _open_after_idle(url: str, idle_s: float) -> bool:
    """Answers one keep-alive GET on a raw connection, leaves it idle `idle_s`, and tells
    whether the gateway still holds it open (no EOF waiting on it)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += conn.recv(65536)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(
            next(
                line.split(b":")[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
        while len(body) < length:
            body += conn.recv(65536)
        time.sleep(idle_s)
        conn.setblocking(False)
        try:
            return conn.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return True


def test_keep_alive_timeout_is_the_gateways(harness: Harness) -> None:
    """Idle keep-alive connections stay open `keep_alive_timeout_s`: by default longer than
    uvicorn's own 5 s, which closed connections that clients' pools (aiohttp: 15 s) still
    reused, failing the POST sent on one."""
    short = harness.start_gateway(harness.config(keep_alive_timeout_s=1))
    default = harness.start_gateway(harness.config())
    try:
        assert not _open_after_idle(short.url, 2.0)
        assert _open_after_idle(default.url, 5.5)
    finally:
        harness.stop_gateway(short)
        harness.stop_gateway(default)
