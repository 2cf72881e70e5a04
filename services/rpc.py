"""gRPC plumbing: handler decorator (errors → status, metrics, tracing, in-flight
tracking), client channels, health checks and status → exception mapping."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import metrics, tls, tracing
from services.config import MAX_MESSAGE_BYTES
from services.errors import Code, MeshError, classify

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class InflightTracker:
    """Counts RPCs in progress so shutdown can wait for them to drain."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def count(self) -> int:
        return self._count

    def enter(self) -> None:
        self._count += 1
        self._idle.clear()

    def exit(self) -> None:
        self._count -= 1
        if self._count == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when every RPC finished within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


INFLIGHT = InflightTracker()


def grpc_code(code: Code) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code.value)  # type: ignore[no-any-return]


# Trailing-metadata key carrying the request field at fault (OpenAI error `param`).
PARAM_METADATA_KEY = "meshserve-error-param"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = classify(exc)
    if code is Code.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    param = getattr(exc, "param", None)
    metadata = ((PARAM_METADATA_KEY, param),) if isinstance(param, str) and param else None
    await context.abort(grpc_code(code), message, trailing_metadata=metadata or ())


def _status_name(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


def rpc_handler(func: F) -> F:
    """Wraps a servicer method (unary or server-streaming).

    Maps exceptions to status codes (ValueError → INVALID_ARGUMENT, MeshError → its
    code, anything else → INTERNAL with a log), records metrics, continues the trace
    from the caller's metadata and counts the call as in flight for draining.
    """
    method = func.__qualname__
    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def stream_wrapper(
            self: Any, request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async with _served(method, context):
                async for item in func(self, request, context):
                    yield item

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(func)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _served(method, context):
            return await func(self, request, context)
        raise RuntimeError("unreachable: _served aborts the call on every error")

    return unary_wrapper  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def _served(method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """One RPC's scope: in-flight count, trace span, metrics, and error → status."""
    start = time.perf_counter()
    INFLIGHT.enter()
    try:
        with tracing.server_span(method, context):
            yield
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as exc:
        await _abort(context, exc, method)
    finally:
        INFLIGHT.exit()
        metrics.observe_rpc(method, _status_name(context), time.perf_counter() - start)


class StreamInput(Protocol):
    """What a bidirectional-stream servicer feeds the client's messages to."""

    def handle(self, message: Any) -> Awaitable[None] | None:
        """One message from the client; may return an awaitable (e.g. writing answers
        ready at once) that the reader awaits before it reads the next message."""

    def input_done(self) -> None:
        """The client half-closed or went away: no more messages."""


async def feed_stream(request_iterator: AsyncIterator[Any], session: StreamInput, method: str) -> None:
    """Feeds the client's messages of a bidirectional stream to `session` until the
    client half-closes or goes away (run it as a task beside the responses)."""
    try:
        async for message in request_iterator:
            pending = session.handle(message)
            if pending is not None:
                await pending
    except grpc.aio.AioRpcError:  # the client went away: the call's end closes the session
        pass
    except Exception:
        log.exception("reading a %s stream failed; its requests end", method)
    finally:
        session.input_done()


# Clients ping idle connections this often (and servers accept it, `server_options`);
# a ping not answered within PING_TIMEOUT_MS ends the connection (a hung peer).
KEEPALIVE_TIME_MS = 10_000
PING_TIMEOUT_MS = 5_000
# The channels a request waits on (the gateway's worker streams, a hand-off's KV channel)
# ping four times a second: a peer that answers none for 0.75 s (hung, SIGSTOPped) fails
# their calls, and the requests move on (docs/design-decisions.md, "Hung workers found in
# about a second").
REQUEST_PING_MS, REQUEST_PING_TIMEOUT_MS = 250, 750


def channel_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    ping_ms: int = KEEPALIVE_TIME_MS,
    ping_timeout_ms: int = PING_TIMEOUT_MS,
) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Fail fast and reconnect quickly when a peer restarts.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", ping_timeout_ms),
        # gRPC core times pings out after this (its default, a minute, whatever
        # keepalive_timeout says), so without it a SIGSTOPped peer holds its streams a minute.
        ("grpc.http2.ping_timeout_ms", ping_timeout_ms),
        # Keep pinging while only the peer sends: a client that reads a long stream sends
        # no data, and the default (2 pings, then none until it does) let a hung
        # (SIGSTOPped) worker hold its streams forever.
        ("grpc.http2.max_pings_without_data", 0),
        # Connect timeout: a hung peer's kernel still accepts TCP, the HTTP/2 handshake
        # never completes; give up after 5 s, not the default 20 s.
        ("grpc.min_reconnect_backoff_ms", 5_000),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel options plus a keepalive policy that accepts our clients' pings: the
    gateway's long-lived worker streams ping every REQUEST_PING_MS (a hung worker is
    detected within about a second), and gRPC's default server policy answers pings more frequent
    than every 5 minutes with GOAWAY "too_many_pings", which broke those streams."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # gRPC sets SO_REUSEPORT by default: a second server on a port already served would bind
        # and silently take half its connections (a second mesh's scheduler, a restarted replica
        # beside a stuck one). Off, the second server fails to start, naming the port.
        ("grpc.so_reuseport", 0),
    ]


def open_channel(
    address: str,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    ping_ms: int = KEEPALIVE_TIME_MS,
    ping_timeout_ms: int = PING_TIMEOUT_MS,
) -> grpc.aio.Channel:
    """An asyncio channel to another service: TLS when this process's --tls-ca is set
    (services.tls.use_client_files), plaintext otherwise; calls carry the current trace context. A peer
    that answers no ping within ``ping_timeout_ms`` (hung) fails the channel's calls."""
    options = channel_options(max_message_bytes, ping_ms, ping_timeout_ms)
    interceptors = tracing.client_interceptors()
    credentials = tls.channel_credentials(tls.client_files())
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


async def check_health(address: str, service: str = "", timeout: float = 1.0) -> bool:
    """True when `address` answers grpc.health.v1 Check with SERVING."""
    async with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


# The codes of a call whose peer is gone rather than one the peer answered: gRPC reports
# a refused connection, a peer killed or exiting mid-call and a server stopping as
# UNAVAILABLE, a call the peer dropped as CANCELLED. A peer's own errors (its exceptions:
# UNKNOWN; INVALID_ARGUMENT, INTERNAL, ...) carry other codes: another peer would fail alike.
PEER_LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def peer_lost(exc: grpc.aio.AioRpcError) -> bool:
    """True when the call failed because its peer is unreachable or went away: worth
    trying another replica of the same service."""
    return exc.code() in PEER_LOST


def error_from_rpc(exc: grpc.aio.AioRpcError) -> MeshError:
    """Converts a failed call into a MeshError carrying the peer's code and message."""
    try:
        code = Code(exc.code().name)
    except ValueError:
        code = Code.INTERNAL
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN) and not exc.details():
        code = Code.UNAVAILABLE
    error = MeshError(exc.details() or code.value, param=_error_param(exc))
    error.code = code
    return error


def _error_param(exc: grpc.aio.AioRpcError) -> str | None:
    for key, value in exc.trailing_metadata() or ():
        if key == PARAM_METADATA_KEY and isinstance(value, str):
            return value
    return None
