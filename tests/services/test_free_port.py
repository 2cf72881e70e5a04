"""Ports for meshes started beside others: free, never handed out twice, and outside the
kernel's ephemeral range (where an outgoing connection could take one before its service
binds it)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services import ports
from services.ports import free_port


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_are_free_distinct_and_not_ephemeral() -> None:
    low, high = _ephemeral_range()
    starts = [free_port(count=8) for _ in range(40)]
    ports = [p for start in starts for p in range(start, start + 8)]
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    assert not [p for p in ports if low <= p <= high], "a port from the ephemeral range"
    for port in ports:
        # As the services bind (SO_REUSEADDR): a port whose last connection is in TIME_WAIT
        # is free for them, and for the picker.
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))


def test_a_port_another_socket_holds_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The picker's first choice is a port something already listens on: it moves on. The
    process-wide record of ports handed out starts empty here, so what earlier tests were
    given cannot veto the scripted choices."""
    monkeypatch.setattr(ports, "_handed_out", set())
    with socket.socket() as held:
        for port in range(24000, 24100):
            try:
                held.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        held.listen()
        choices = iter([port - 1, port + 50])
        monkeypatch.setattr(ports.random, "randrange", lambda *_: next(choices))
        assert free_port(count=2) == port + 50
