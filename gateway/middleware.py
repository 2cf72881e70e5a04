"""Pure-ASGI middleware in front of every route: request metrics, drain (503),
API keys (401), per-key rate limit (429) and the request body size limit (413). It
hands well-formed generation requests to their endpoints itself (gateway.direct_routes).

It stores the caller's tenant (`key-<sha256 prefix>` or "anonymous") and the arrival
time in `scope["state"]`, where handlers read them as `request.state.tenant` and
`request.state.start_time`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import metrics
from gateway.config import GatewayConfig
from gateway.direct_routes import DirectRoute
from gateway.errors import APIError
from gateway.ratelimit import RateLimiter

ANONYMOUS = "anonymous"
# Answered without an API key; never rate limited nor refused while draining.
PUBLIC_PATHS = frozenset({"/health"})
OBSERVABILITY_PATHS = frozenset({"/health", "/metrics"})
ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/openapi.json",
        "/docs",
    }
)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def route_label(path: str) -> str:
    """Bounded-cardinality route label for metrics."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return "other"


def tenant_of(key: str) -> str:
    """Stable tenant id of an API key that does not reveal the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class GatewayState:
    """Process-wide gateway state: drain flag and requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.in_flight == 0:
                self._idle.set()
        return self._idle

    def enter(self) -> None:
        """A request started."""
        self.in_flight += 1
        self._event().clear()

    def exit(self) -> None:
        """A request finished (its last byte was sent)."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self._event().set()

    def start_drain(self) -> None:
        """New requests are answered 503 from now on."""
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """True when every request finished within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._event().wait(), timeout)
        except TimeoutError:
            return False
        return True


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class GatewayMiddleware:
    """See the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        config: GatewayConfig,
        state: GatewayState,
        direct: Mapping[str, DirectRoute] | None = None,
    ) -> None:
        """`direct`: POST routes served past FastAPI when the request is well-formed
        (gateway.direct_routes), by path."""
        self.app = app
        self.direct = dict(direct or {})
        self.config = config
        self.state = state
        self.limiter = RateLimiter(config.rate_limit_rps_per_key, config.rate_limit_burst)
        self._keys = {key: tenant_of(key) for key in config.api_keys}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Counts and times the request around `_handle`."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = route_label(path)
        start = time.perf_counter()
        scope.setdefault("state", {})["start_time"] = start
        status = 499  # stays 499 when the client goes away before any response
        tracked = path not in OBSERVABILITY_PATHS

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        metrics.IN_FLIGHT.labels(route).inc()
        if tracked:
            self.state.enter()
        try:
            await self._handle(scope, receive, send_wrapper, path)
        finally:
            metrics.IN_FLIGHT.labels(route).dec()
            if tracked:
                self.state.exit()
            metrics.REQUESTS.labels(route, str(status)).inc()
            metrics.E2E_LATENCY.labels(route).observe(time.perf_counter() - start)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        error = self._admit(scope, path)
        if error is not None:
            if scope.get("method") in _BODY_METHODS:
                # Read the body we refuse: closing a socket with unread bytes sends a TCP
                # reset that can destroy the error response before the client reads it.
                await _discard_body(receive, self.config.max_request_bytes)
            await error.response(path)(scope, receive, send)
            return
        if scope.get("method") in _BODY_METHODS:
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            receive = _replay(body, receive)
            route = self.direct.get(path) if scope["method"] == "POST" else None
            if route is not None:
                content_type = _header(scope, b"content-type") or ""
                if await route.serve(content_type, body, scope, receive, send):
                    return
        await self.app(scope, receive, send)

    def _admit(self, scope: Scope, path: str) -> APIError | None:
        """Drain, authentication and rate limit; sets the tenant. None = admitted."""
        if self.state.draining and path not in OBSERVABILITY_PATHS:
            return APIError(
                503,
                "The server is shutting down; retry on another instance.",
                code="draining",
                headers={"Connection": "close", "Retry-After": "1"},
            )
        tenant = ANONYMOUS
        if self._keys and path not in PUBLIC_PATHS:
            found = self._authenticate(_header(scope, b"authorization"), _header(scope, b"x-api-key"))
            if found is None:
                return APIError(
                    401,
                    "Incorrect API key provided. Pass it as `Authorization: Bearer <key>` (or `x-api-key: <key>`).",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            tenant = found
        scope["state"]["tenant"] = tenant
        if path in OBSERVABILITY_PATHS:
            return None
        wait = self.limiter.acquire(tenant)
        if wait > 0:
            return APIError(
                429,
                f"Rate limit of {self.config.rate_limit_rps_per_key:g} requests/s per key exceeded.",
                code="rate_limit_exceeded",
                headers={"Retry-After": RateLimiter.retry_after_header(wait)},
            )
        return None

    def _authenticate(self, header: str | None, api_key: str | None) -> str | None:
        """The tenant of a valid `Authorization: Bearer <key>` header, or else of a valid
        `x-api-key: <key>` header (Anthropic's clients), else None (constant-time compare)."""
        if header and header[:7].lower() == "bearer ":
            given = header[7:].strip().encode()
        elif api_key:
            given = api_key.strip().encode()
        else:
            return None
        found = None
        for key, tenant in self._keys.items():
            if hmac.compare_digest(given, key.encode()):
                found = tenant
        return found

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The body, up to the limit; answers 413 (and returns None) beyond it."""
        limit = self.config.max_request_bytes
        length = _header(scope, b"content-length")
        too_large = length is not None and length.isdigit() and int(length) > limit
        chunks: list[bytes] = []
        size = 0
        more = not too_large
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                too_large = True
                break
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        if too_large:
            await _too_large(limit, scope["path"])(scope, receive, send)
            return None
        return b"".join(chunks)


async def _discard_body(receive: Receive, limit: int) -> None:
    """Reads and drops the request body, at most `limit` bytes (stops on disconnect)."""
    size = 0
    while size <= limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _too_large(limit: int, path: str) -> Any:
    return APIError(
        413,
        f"Request body too large: the limit is {limit} bytes.",
        code="request_too_large",
        headers={"Connection": "close"},
    ).response(path)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the buffered body once, then the real messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
