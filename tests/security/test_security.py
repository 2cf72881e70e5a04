"""Security checks against the shared real mesh plus a second, locked-down gateway.

* API keys: every route but /health answers 401 without a valid `Bearer` key.
* Per-key rate limit: a burst over the bucket answers 429 with Retry-After; other keys
  are not affected.
* Chat templates: refused by default; where the operator allows request templates, the
  sandbox still refuses any template that reaches Python internals.
* Remote image fetch is off by default: an http(s) image_url is a 400 and the URL is
  never contacted.
* Size limits: gateway body limit (413) and gRPC max message size on every gRPC server
  (RESOURCE_EXHAUSTED, service alive).
* gRPC between services is plaintext unless mutual TLS is configured (tests/services/test_tls.py).
"""

from __future__ import annotations

import asyncio
import http.server
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import MAX_MESSAGE_BYTES
from tests.mesh import (
    API_KEYS,
    MODEL_NAME,
    RATE_LIMIT_BURST,
    RATE_LIMIT_RPS,
    RunningMesh,
    chat_body,
    gateway_spec,
    tokenizer_spec,
)

ALPHA, BETA = API_KEYS
# Routes that exist but are not in the OpenAPI document.
EXTRA_ROUTES = [
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/docs/oauth2-redirect"),
    ("GET", "/redoc"),
]


@pytest.fixture(scope="module")
def secure_url(mesh: RunningMesh) -> str:
    """A gateway with API keys and a per-key rate limit, on a tokenizer whose operator
    allows request-supplied chat templates (both extra processes on the shared mesh)."""
    mesh.add_service(
        tokenizer_spec(mesh, "tokenizer-permissive", MESHSERVE_ALLOW_REQUEST_CHAT_TEMPLATE="true")
    )
    spec = gateway_spec(
        mesh,
        "gateway-secure",
        tokenizer="tokenizer-permissive",
        MESHSERVE_API_KEYS=",".join(API_KEYS),
        MESHSERVE_RATE_LIMIT_RPS_PER_KEY=str(RATE_LIMIT_RPS),
        MESHSERVE_RATE_LIMIT_BURST=str(RATE_LIMIT_BURST),
    )
    mesh.add_service(spec)
    url = f"http://{spec.address}"
    _authed(url, "GET", "/health")
    return url


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _authed(
    url: str, method: str, path: str, key: str = ALPHA, headers: dict[str, str] | None = None, **kw: Any
) -> httpx.Response:
    """A request with a valid key (as `Bearer`, or in `headers`), waiting out 429s (the rate
    limit is part of this gateway)."""
    for _ in range(20):
        reply = httpx.request(method, url + path, headers=headers or _auth(key), timeout=60, **kw)
        if reply.status_code != 429:
            return reply
        time.sleep(float(reply.headers.get("Retry-After", "1")))
    raise AssertionError(f"{method} {path} still rate limited")


def _routes(url: str) -> list[tuple[str, str]]:
    schema = _authed(url, "GET", "/openapi.json").json()
    routes = []
    for path, operations in schema["paths"].items():
        for method in operations:
            routes.append((method.upper(), path.replace("{model}", MODEL_NAME)))
    return routes + EXTRA_ROUTES + [("GET", "/no/such/route"), ("POST", "/v1/no-such")]


def test_every_route_but_health_requires_an_api_key(secure_url: str) -> None:
    """No key, a wrong key, a non-Bearer scheme, an empty bearer or a wrong `x-api-key`
    (Anthropic's clients' header) → 401 on every route (unknown ones included); /health
    alone answers without a key."""
    routes = _routes(secure_url)
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/metrics") in routes
    bad_headers: list[dict[str, str]] = [
        {},
        _auth("sk-wrong"),
        _auth(ALPHA + "x"),
        _auth(ALPHA[:-1]),
        {"Authorization": f"Basic {ALPHA}"},
        {"Authorization": "Bearer"},
        {"Authorization": ALPHA},
        {"X-API-Key": "sk-wrong"},
        {"X-API-Key": ALPHA + "x"},
        {"Authorization": "Bearer sk-wrong", "X-API-Key": ALPHA},
    ]
    unprotected = []
    for method, path in routes:
        if path == "/health":
            continue
        for headers in bad_headers:
            reply = httpx.request(method, secure_url + path, headers=headers, json={}, timeout=30)
            if reply.status_code != 401:
                unprotected.append(f"{method} {path} {headers} -> {reply.status_code}")
            else:
                assert reply.json()["error"]["type"] == "authentication_error"
                assert reply.headers.get("WWW-Authenticate") == "Bearer"
    assert not unprotected, unprotected
    assert httpx.get(secure_url + "/health", timeout=30).status_code == 200
    for method, path in routes:
        reply = _authed(secure_url, method, path, json={} if method == "POST" else None)
        assert reply.status_code != 401, f"{method} {path} refused a valid key"
    for headers in ({"X-API-Key": ALPHA}, {"x-api-key": BETA}):
        reply = _authed(secure_url, "GET", "/v1/models", headers=headers)
        assert reply.status_code == 200, reply.text


def test_valid_key_serves_a_completion(secure_url: str) -> None:
    """The second key works as well as the first (keys are independent tenants)."""
    reply = _authed(secure_url, "POST", "/v1/chat/completions", key=BETA, json=chat_body(max_tokens=2))
    assert reply.status_code == 200, reply.text


def test_rate_limit_is_per_key_with_retry_after(secure_url: str) -> None:
    """A burst of 3x the bucket from one key gets 429s (Retry-After, rate_limit_error);
    the other key is served meanwhile; the first key recovers after the refill."""
    time.sleep(RATE_LIMIT_BURST / RATE_LIMIT_RPS)  # both buckets full again

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=secure_url, headers=_auth(BETA), timeout=30) as client:
            return list(
                await asyncio.gather(*(client.get("/v1/models") for _ in range(3 * RATE_LIMIT_BURST)))
            )

    started = time.monotonic()
    replies = asyncio.run(burst())
    # Tokens refilled while the burst ran (a busy host stretches it) are served too.
    refilled = math.ceil((time.monotonic() - started) * RATE_LIMIT_RPS) + 1
    codes = [r.status_code for r in replies]
    limited = [r for r in replies if r.status_code == 429]
    assert set(codes) <= {200, 429}, codes
    assert limited, codes
    assert codes.count(200) <= RATE_LIMIT_BURST + refilled, codes
    for reply in limited:
        assert reply.json()["error"]["type"] == "rate_limit_error"
        assert int(reply.headers["Retry-After"]) >= 1
    other = httpx.get(secure_url + "/v1/models", headers=_auth(ALPHA), timeout=30)
    assert other.status_code == 200, "one key's burst throttled another key"
    time.sleep(1.5 / RATE_LIMIT_RPS)
    assert httpx.get(secure_url + "/v1/models", headers=_auth(BETA), timeout=30).status_code == 200


def test_health_is_never_rate_limited(secure_url: str) -> None:
    """Probes must not be throttled: /health answers 200 in a burst without a key."""
    codes = [httpx.get(secure_url + "/health", timeout=30).status_code for _ in range(3 * RATE_LIMIT_BURST)]
    assert set(codes) == {200}, codes


def test_request_chat_template_refused_by_default(mesh: RunningMesh) -> None:
    """The default tokenizer does not run templates from requests at all."""
    body = chat_body(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    reply = httpx.post(mesh.gateway_url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "chat_template" in reply.json()["error"]["message"]


PRIVATE = ("chat_template", "accesses the private attribute")
SANDBOX = ("chat_template", "refused by the sandbox")
# (template, the error's `param`, what its message says): each refusal must come from the
# check or the sandbox that is meant to catch it, not from some later accident.
ESCAPES = [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", *PRIVATE),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", *PRIVATE),
    ("{{ lipsum.__globals__['os'].system('id') }}", *PRIVATE),
    ("{{ self._TemplateReference__context }}", *PRIVATE),
    ("{{ messages | attr('__class__') }}", *PRIVATE),
    ("{{ ''['__class__'] }}", *PRIVATE),
    ("{{ namespace.__init__.__globals__ }}", *PRIVATE),
    ("{% set x = joiner %}{{ x.__call__.__globals__ }}", *PRIVATE),
    ("{{ messages | attr('_' ~ '_cla' ~ 'ss_' ~ '_') }}", *PRIVATE),
    ("{{ (messages | first)['content'].format.__globals__ }}", *PRIVATE),
    ("{{ messages.append({'role': 'system', 'content': 'pwned'}) }}", *SANDBOX),
    ("{{ messages[0].update({'content': 'pwned'}) }}", *SANDBOX),
    (
        "{% raw %}{{ x }}{% endraw %}{{ raise_exception('refused') }}",
        "messages",
        "could not render the messages: refused",
    ),
]
# A user template that raises while rendering (the sandbox's range cap, arithmetic errors)
# is a bad request: 400, never a 500.
RENDER_ERRORS = [
    pytest.param(
        "{{ range(10**9) | list | length }}", "messages", "Range too big", id="sandbox-range-limit-overflow"
    ),
    pytest.param("{{ 1 / 0 }}", "messages", "division by zero", id="zero-division"),
]


@pytest.mark.parametrize(
    ("template", "param", "says"),
    [*ESCAPES, *RENDER_ERRORS],
    ids=[f"escape-{i}" for i in range(len(ESCAPES))] + [None, None],
)
def test_sandbox_refuses_python_internals_when_templates_are_allowed(
    secure_url: str, template: str, param: str, says: str
) -> None:
    """With allow_request_chat_template on, escape attempts are still refused with 400
    (statically, or by the immutable sandbox at render time) - never run, never a 500."""
    reply = _authed(
        secure_url, "POST", "/v1/chat/completions", json=chat_body(chat_template=template, max_tokens=1)
    )
    assert reply.status_code == 400, f"{reply.status_code}: {reply.text[:300]}"
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert says in error["message"], error


def test_allowed_request_template_really_renders(secure_url: str) -> None:
    """Control: on that gateway a harmless request template is accepted, so the refusals
    above come from the sandbox, not from templates being off."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    reply = _authed(
        secure_url, "POST", "/v1/chat/completions", json=chat_body(chat_template=template, max_tokens=2)
    )
    assert reply.status_code == 200, reply.text


class _CountingHandler(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture()
def image_host() -> Iterator[tuple[str, type[_CountingHandler]]]:
    """A loopback HTTP server that counts the requests it receives."""
    handler = type("Handler", (_CountingHandler,), {"hits": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_remote_image_fetch_is_off_by_default(
    mesh: RunningMesh, image_host: tuple[str, type[_CountingHandler]], scheme: str
) -> None:
    """An http(s) image_url → 400 naming the field, and the host is never contacted."""
    host, handler = image_host
    content = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": f"{scheme}://{host}/cat.png"}},
    ]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    reply = httpx.post(mesh.gateway_url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "image_url" in reply.json()["error"]["message"]
    assert handler.hits == 0


def test_gateway_body_limit_is_413(mesh: RunningMesh) -> None:
    """A body over max_request_bytes (16 MiB) → 413 without being processed."""
    body = (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * (17 * 1024 * 1024) + b'"}]}'
    )
    reply = httpx.post(
        mesh.gateway_url + "/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert reply.status_code == 413, reply.text[:300]
    assert reply.json()["error"]["code"] == "request_too_large"


def _oversized(length: int) -> bytes:
    """Field 1 (length-delimited) holding `length` bytes: over the limit for any message."""
    key, size, head = 0x0A, length, bytearray()
    head.append(key)
    while True:
        byte, size = size & 0x7F, size >> 7
        head.append(byte | (0x80 if size else 0))
        if not size:
            return bytes(head) + b"x" * length


GRPC_SERVICES = [
    ("tokenizer", "/meshserve.v1.Tokenizer/GetTokenizerInfo"),
    ("scheduler", "/meshserve.v1.Scheduler/ListWorkers"),
    ("decoder-0", "/meshserve.v1.Worker/LoadLora"),
    ("decoder-1", "/meshserve.v1.Worker/Embed"),
    ("encoder-cache", "/meshserve.v1.EncoderCache/Has"),
]


@pytest.mark.parametrize(("service", "method"), GRPC_SERVICES, ids=[s for s, _ in GRPC_SERVICES])
def test_grpc_message_size_limit_on_every_server(mesh: RunningMesh, service: str, method: str) -> None:
    """A request over max_message_bytes (64 MiB) → RESOURCE_EXHAUSTED; the server lives on
    and answers health checks."""
    payload = _oversized(MAX_MESSAGE_BYTES + 4096)

    async def call() -> grpc.aio.AioRpcError | None:
        options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
        async with grpc.aio.insecure_channel(mesh.address(service), options=options) as channel:
            raw = channel.unary_unary(
                method, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            try:
                await raw(payload, timeout=60)
            except grpc.aio.AioRpcError as exc:
                return exc
            return None

    error = asyncio.run(call())
    assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "larger than max" in (error.details() or "")
    assert mesh.alive(service)
    assert asyncio.run(_health(mesh.address(service))) == health_pb2.HealthCheckResponse.SERVING


async def _health(address: str, credentials: grpc.ChannelCredentials | None = None) -> int:
    channel = (
        grpc.aio.secure_channel(address, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(address)
    )
    async with channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


def test_shared_mesh_is_plaintext_by_default(mesh: RunningMesh) -> None:
    """TLS is opt-in (MESHSERVE_TLS_*; mutual TLS is tested in tests/services/test_tls.py):
    every gRPC service of a mesh started without it answers SERVING to a plaintext health check."""
    services = [spec for spec in mesh.specs.values() if spec.grpc]
    assert {"scheduler", "tokenizer"} <= {spec.name for spec in services}
    for spec in services:
        status = asyncio.run(_health(spec.address, None))
        assert status == health_pb2.HealthCheckResponse.SERVING, spec.name
