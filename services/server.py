"""Async gRPC server bootstrap: health, reflection, metrics endpoint, and
signal → drain → stop shutdown.

Lifecycle of a service process:
  1. `GrpcServer(...)`, `add_service(...)` for each servicer, `await start()`;
     health reports NOT_SERVING until the service calls `set_serving(True)`
     (e.g. once the model is loaded).
  2. `await run_until_signal()` waits for SIGTERM/SIGINT, then drains: health flips
     to NOT_SERVING, `on_drain` hooks run (e.g. a worker tells the scheduler), new
     calls are refused with UNAVAILABLE while calls in flight get up to
     `drain_timeout_s` to finish, then the server stops and queued spans are exported.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

try:
    import uvloop
except ImportError:  # optional: plain asyncio works too
    uvloop = None  # type: ignore[assignment]

from services import metrics, tracing
from services.config import ProcessConfig, ServerConfig
from services.decode_guard import DecodeGuard
from services.gc_tuning import settle_heap
from services.rpc import INFLIGHT, server_options
from services.tls import process_files, server_credentials, use_client_files

log = logging.getLogger(__name__)

DrainHook = Callable[[], Awaitable[None]]


class GrpcServer:
    """One asyncio gRPC server with health, reflection and graceful drain."""

    def __init__(self, name: str, config: ServerConfig) -> None:
        self.name = name
        self.config = config
        self.server = grpc.aio.server(
            options=server_options(config.max_message_bytes), interceptors=[DecodeGuard()]
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self._drain_hooks: list[DrainHook] = []
        self._stop = asyncio.Event()
        self.draining = False
        self.port = 0
        self.metrics_port = 0

    def add_service(
        self, full_name: str, add_fn: Callable[[Any, grpc.aio.Server], None], servicer: Any
    ) -> None:
        """Registers a servicer, e.g. `add_service("meshserve.v1.Worker", add_WorkerServicer_to_server, s)`."""
        add_fn(servicer, self.server)
        self._service_names.append(full_name)

    def on_drain(self, hook: DrainHook) -> None:
        self._drain_hooks.append(hook)

    async def start(self) -> int:
        """Binds, starts serving (health NOT_SERVING) and returns the bound port."""
        tracing.setup_tracing(self.name, self.config.tracing, self.config.otlp_endpoint)
        reflection.enable_server_reflection(self._service_names, self.server)
        address = f"{self.config.host}:{self.config.port}"
        credentials = server_credentials(process_files(self.config))
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        await self.server.start()
        await self.set_serving(False)
        if self.config.metrics_port > 0:
            self.metrics_port = metrics.serve_metrics(self.config.metrics_port, self.config.host)
        log.info("%s listening on %s:%d", self.name, self.config.host, self.port)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Sets the overall ("") and per-service health status."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving and not self.draining
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        for name in ["", *self._service_names]:
            await self.health.set(name, status)
        if serving:
            settle_heap()  # start-up is over: what lives now lives as long as the process

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def run_until_signal(self) -> None:
        """Serves until SIGTERM/SIGINT (or `request_stop`), then drains and stops."""
        self.install_signal_handlers()
        await self._stop.wait()
        await self.drain_and_stop()

    async def drain_and_stop(self) -> None:
        self.draining = True
        await self.set_serving(False)
        log.info("%s draining: %d calls in flight", self.name, INFLIGHT.count)
        for hook in self._drain_hooks:
            try:
                await hook()
            except Exception:
                log.exception("drain hook failed")
        # stop(grace) refuses new calls at once and lets in-flight ones finish.
        stopping = asyncio.create_task(self.server.stop(self.config.drain_timeout_s))
        drained = await INFLIGHT.wait_idle(self.config.drain_timeout_s)
        if not drained:
            log.warning("%s: drain timeout, cancelling %d calls", self.name, INFLIGHT.count)
        await stopping
        # The last calls' spans wait in the batch processor: send them now, since the
        # process may be killed after its drain (run_service's shutdown sends the rest).
        if not await tracing.flush_tracing():
            log.warning("%s: span export still running when the drain ended", self.name)
        log.info("%s stopped", self.name)


def run_service(main: Callable[[], Coroutine[Any, Any, None]], config: ProcessConfig) -> None:
    """Runs a service's async main in a fresh event loop (process entry points), with
    `config`'s client TLS files for its channels: uvloop when installed (less per-message
    overhead on the streaming hot path) unless ``config.uvloop`` is off. Queued spans are
    exported before it returns."""
    use_client_files(process_files(config))
    try:
        if uvloop is not None and config.uvloop:
            uvloop.run(main())
        else:
            asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        tracing.shutdown_tracing()
