"""Redis access shared by services, plus a managed redis-server for tests and the
local launcher."""

from __future__ import annotations

import logging
import random
import shutil
import socket
import subprocess
import tempfile
import time

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

KEY_PREFIX = "meshserve:"


def connect(url: str) -> aioredis.Redis:
    """An asyncio Redis client with short timeouts: callers treat Redis as optional
    shared state and fall back to local state when it is unreachable."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=1.0,
        socket_connect_timeout=1.0,
        health_check_interval=5,
        decode_responses=False,
    )


# Ports for services started beside others (tests, benchmarks) come from below the kernel's
# ephemeral range (32768-60999 by default): a port bind(0) just returned can be taken by any
# outgoing connection before the service binds it; these cannot.
_PORT_RANGE = (20000, 32768)
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """The first of `count` consecutive ports free on `host`, none handed out before by this
    process (a service with replicas listens on port + i)."""
    for _ in range(1000):
        start = random.randrange(_PORT_RANGE[0], _PORT_RANGE[1] - count)
        ports = range(start, start + count)
        if not _handed_out.isdisjoint(ports) or not all(_bindable(host, p) for p in ports):
            continue
        _handed_out.update(ports)
        return start
    raise RuntimeError(f"no {count} consecutive free ports in {_PORT_RANGE} on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class RedisServer:
    """A real redis-server process on loopback, in its own temp dir."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self._dir = tempfile.mkdtemp(prefix="meshserve-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install it (apt-get install -y redis-server)")
        cmd = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            self._dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        """The redis-server's process id while it runs (fault tests signal it)."""
        return self._proc.pid if self.is_running() and self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None
