"""Who listens on a TCP port: the launcher's checks that a port is free and that the process
answering on it is the one it started (Linux /proc; elsewhere nothing is known and nothing is refused),
and free ports for meshes started beside others.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port`` on any address, IPv4 or IPv6, in this network namespace."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets open in process ``pid`` (empty if it is gone or not ours to read)."""
    found: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


def listens(pid: int, port: int) -> bool:
    """True when process ``pid`` holds a socket listening on ``port``."""
    return bool(_listening_inodes(port) & _socket_inodes(pid))


def listeners(port: int) -> list[int]:
    """Pids of every process holding a socket that listens on ``port``."""
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    pids = (int(name) for name in os.listdir("/proc") if name.isdigit())
    return sorted(pid for pid in pids if inodes & _socket_inodes(pid))


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(raw.decode(errors="replace").split("\0")).strip() or "?"


def busy(host: str, port: int) -> str | None:
    """None when a server could listen on ``host:port``; else who holds it, e.g.
    ``"pid 4242 (python -m gateway)"``. SO_REUSEADDR as servers set it: a closed connection
    still in TIME_WAIT does not count as busy."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            holders = ", ".join(f"pid {pid} ({_command(pid)})" for pid in listeners(port))
            return holders or exc.strerror or str(exc)
    return None


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
        if _handed_out.isdisjoint(ports) and not any(busy(host, p) for p in ports):
            _handed_out.update(ports)
            return start
    raise RuntimeError(f"no {count} consecutive free ports in {_PORT_RANGE} on {host}")
