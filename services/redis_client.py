"""Redis access shared by services, plus a managed redis-server for tests and the
local launcher."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time

import redis.asyncio as aioredis

from services.ports import free_port

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
