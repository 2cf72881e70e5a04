"""`python -m gateway [--port PORT --tokenizer-address ... --scheduler-address ... --api-keys k1,k2]`

Runs the gateway under uvicorn. Shutdown on SIGTERM/SIGINT is graceful: the gateway
starts draining (new requests and /health answer 503), requests in flight (streams
included) get up to `--drain-timeout-s` to finish, then uvicorn stops. A second
signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from types import FrameType
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.middleware import GatewayState
from services.config import load_config
from services.log import setup_logging
from services.tls import process_files, use_client_files

log = logging.getLogger("gateway")
# After the drain, how long uvicorn waits for the last connections before cancelling.
FINAL_GRACE_S = 2


class GatewayServer(uvicorn.Server):
    """uvicorn server whose first SIGTERM/SIGINT drains the gateway before stopping."""

    def __init__(self, config: uvicorn.Config, state: GatewayState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.gateway_state = state
        self.drain_timeout_s = drain_timeout_s
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        """Remembers the loop so the signal handler can schedule the drain on it."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain then exit; second signal: exit now."""
        if self.gateway_state.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self.gateway_state.draining
            return
        self.gateway_state.start_drain()
        log.info("signal %d: draining (%d requests in flight)", sig, self.gateway_state.in_flight)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        drained = await self.gateway_state.wait_idle(self.drain_timeout_s)
        if not drained:
            log.warning("drain timeout: %d requests still in flight", self.gateway_state.in_flight)
        self.should_exit = True


def main(argv: list[str] | None = None) -> None:
    """Process entry point."""
    config = load_config(GatewayConfig, sys.argv[1:] if argv is None else argv, prog="python -m gateway")
    setup_logging("gateway", config.log_level)
    use_client_files(process_files(config))  # its channels to the tokenizer, scheduler, workers
    app = create_app(config)
    server = GatewayServer(server_config(app, config), app.state.gateway, config.drain_timeout_s)
    server.run(sockets=[shared_socket(config.host, config.port)] if config.reuse_port else None)


def shared_socket(host: str, port: int) -> socket.socket:
    """The HTTP port bound with SO_REUSEPORT: other gateway replicas bind it too and the
    kernel spreads new connections over the replicas listening (a dead one gets none)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def server_config(app: Any, config: GatewayConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for the gateway `app` (`overrides`: test harnesses' own)."""
    settings: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "log_level": config.log_level.lower(),
        "access_log": config.access_log,
        "timeout_keep_alive": config.keep_alive_timeout_s,
        "timeout_graceful_shutdown": FINAL_GRACE_S,
        "log_config": None,
        "loop": "auto" if config.uvloop else "asyncio",  # auto: uvloop when installed
    }
    return uvicorn.Config(app, **(settings | overrides))


if __name__ == "__main__":
    main()
