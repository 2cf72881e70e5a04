"""gRPC contract fuzz: malformed and hostile messages sent straight to each service's port
(tokenizer, scheduler, decoder worker, encoder cache) of the shared real mesh.

Every bad message must end in a client-error status with a message (INVALID_ARGUMENT,
NOT_FOUND, RESOURCE_EXHAUSTED for oversize, ...), never INTERNAL/UNKNOWN, and no
service may crash: the last test checks every process is alive and /health is 200.

The token path: a route on `Scheduler.RouteStream` refuses bad requests with a client
error (every lease it answers here is released at once, and the replica counts it
released); a release on the stream takes any lease ids (unknown ones are simply not
released); a bad add on a `Worker.GenerateStream` fails only that request (a
`RequestError` with a client-error code) and the stream stays usable.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshserve.v1 import (
    common_pb2,
    encoder_cache_pb2,
    encoder_cache_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.config import MAX_MESSAGE_BYTES
from tests.mesh import ENCODER_CACHE_MB, MODEL_NAME, RunningMesh
from tests.scheduler_svc.route_client import RouteClient

CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# The same codes as numbers (what a RequestError carries).
CLIENT_ERROR_NUMBERS = {int(code.value[0]) for code in CLIENT_ERRORS}
# Default max_message_bytes of every gRPC server (services.config.ServerConfig).
VOCAB = 1000  # the tiny model's embedding rows (the tokenizer adds <image> = 1000)
MAX_MODEL_LEN = 2048
CALL_TIMEOUT_S = 20.0
# Client channels may send more than the servers accept, to test the servers' limits.
BIG_CHANNEL = [
    ("grpc.max_send_message_length", 3 * MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", 3 * MAX_MESSAGE_BYTES),
]

Call = Callable[[grpc.aio.Channel], Awaitable[Any]]


@dataclass(frozen=True)
class Case:
    """One hostile call: which service, what to send, which status codes are acceptable."""

    id: str
    service: str
    call: Call
    expect: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.INVALID_ARGUMENT})


async def _stream(call: Any) -> list[Any]:
    return [message async for message in call]


def _gen(**kw: Any) -> common_pb2.GenerateRequest:
    base: dict[str, Any] = {"request_id": "fuzz", "model": MODEL_NAME, "prompt_token_ids": [1, 2, 3]}
    base.update(kw)
    return common_pb2.GenerateRequest(**base)


def _sp(**kw: Any) -> common_pb2.SamplingParams:
    kw.setdefault("max_tokens", 2)
    return common_pb2.SamplingParams(**kw)


def _routed(
    request: common_pb2.GenerateRequest, exclude: Sequence[str] = (), force_encode: bool = False
) -> Call:
    """A route on a RouteStream; the lease it answers is released at once on the stream
    (`_released` checks the replica counted it)."""

    async def call(ch: grpc.aio.Channel) -> scheduler_pb2.RouteResponse:
        routes = RouteClient(ch)
        try:
            reply = await routes.route(request, exclude, force_encode, timeout=CALL_TIMEOUT_S)
            routes.release(reply.lease_id)
        finally:
            await routes.close()
        return reply

    return call


def _released(mesh: RunningMesh) -> float:
    """Leases the scheduler replica `scheduler` ended because they were released."""
    return mesh.metric("scheduler", "meshserve_scheduler_leases_ended_total", how="released")


def _wait_released(mesh: RunningMesh, count: float, timeout: float = 10.0) -> float:
    """`_released` once it reaches `count` (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while (value := _released(mesh)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


@dataclass
class StreamOutcome:
    """What one GenerateStream answered: the RequestErrors and the finished requests."""

    errors: list[worker_pb2.RequestError]
    finished: list[common_pb2.GenerateResponse]

    def error_of(self, request_id: str) -> worker_pb2.RequestError | None:
        return next((e for e in self.errors if e.request_id == request_id), None)

    def finished_ids(self) -> list[str]:
        return [r.request_id for r in self.finished]


PROBE_ID = "fuzz-probe"


def _probe() -> common_pb2.GenerateRequest:
    return _gen(request_id=PROBE_ID, prompt_token_ids=[1, 5, 6, 7], sampling=_sp(max_tokens=2))


async def _generate_stream(
    address: str, messages: list[worker_pb2.GenerateStreamRequest], timeout: float = 60.0
) -> StreamOutcome:
    """Sends `messages` on ONE GenerateStream; once every add got its end (a RequestError
    or its finished output), adds a valid probe request, waits for it, half-closes and
    reads the stream to its end. An error status of the call raises AioRpcError."""
    adds = sum(1 for m in messages if m.WhichOneof("kind") == "add")
    outgoing: asyncio.Queue[worker_pb2.GenerateStreamRequest | None] = asyncio.Queue()
    for message in messages:
        outgoing.put_nowait(message)

    async def requests() -> AsyncIterator[worker_pb2.GenerateStreamRequest]:
        while (message := await outgoing.get()) is not None:
            yield message

    outcome = StreamOutcome([], [])
    probe_sent = False

    def step() -> None:
        nonlocal probe_sent
        ended = len(outcome.errors) + len(outcome.finished)
        if not probe_sent and ended >= adds:
            probe_sent = True
            outgoing.put_nowait(worker_pb2.GenerateStreamRequest(add=_probe()))
        elif probe_sent and ended >= adds + 1:
            outgoing.put_nowait(None)  # half-close: the stream ends once idle

    async with grpc.aio.insecure_channel(address, options=BIG_CHANNEL) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).GenerateStream(requests(), timeout=timeout)
        step()
        async for response in call:
            outcome.errors.extend(response.errors)
            outcome.finished.extend(o for o in response.outputs if o.finished)
            step()
    return outcome


def _raw(method: str, payload: bytes) -> Call:
    """A unary call with hand-made bytes: the client does not serialize (or validate) anything."""

    def call(ch: grpc.aio.Channel) -> Awaitable[Any]:
        stub = ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return stub(payload, timeout=CALL_TIMEOUT_S)  # type: ignore[no-any-return]

    return call


def _raw_stream(method: str, payload: bytes) -> Call:
    """A bidirectional stream whose one message is hand-made bytes; the request side stays
    open, so only the server can end the call."""

    async def call(ch: grpc.aio.Channel) -> list[Any]:
        stub = ch.stream_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)

        async def requests() -> AsyncIterator[bytes]:
            yield payload
            await asyncio.sleep(30)

        return await _stream(stub(requests(), timeout=CALL_TIMEOUT_S))

    return call


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2) with the given raw payload."""
    key, size, out = (number << 3) | 2, len(payload), bytearray()
    out.append(key)
    while True:
        byte, size = size & 0x7F, size >> 7
        out.append(byte | (0x80 if size else 0))
        if not size:
            return bytes(out) + payload


def _put(*chunks: encoder_cache_pb2.TensorChunk) -> Call:
    async def requests() -> AsyncIterator[encoder_cache_pb2.TensorChunk]:
        for chunk in chunks:
            yield chunk

    return lambda ch: encoder_cache_pb2_grpc.EncoderCacheStub(ch).Put(requests(), timeout=CALL_TIMEOUT_S)


def _meta(
    identifier: str = "fuzz", dtype: str = "float32", shape: tuple[int, ...] = (2,), num_bytes: int = 8
) -> encoder_cache_pb2.TensorMeta:
    return encoder_cache_pb2.TensorMeta(
        identifier=identifier, dtype=dtype, shape=list(shape), num_bytes=num_bytes
    )


def _tok(method: str, request: Any) -> Call:
    return lambda ch: getattr(tokenizer_pb2_grpc.TokenizerStub(ch), method)(request, timeout=CALL_TIMEOUT_S)


def _render_chat(messages_json: str = '[{"role": "user", "content": "hi"}]', **kw: Any) -> Call:
    return _tok(
        "RenderChat", tokenizer_pb2.RenderChatRequest(model=MODEL_NAME, messages_json=messages_json, **kw)
    )


def _image_chat(url: str) -> Call:
    content = f'[{{"type": "text", "text": "see"}}, {{"type": "image_url", "image_url": {{"url": "{url}"}}}}]'
    return _render_chat(f'[{{"role": "user", "content": {content}}}]')


NAN, INF = math.nan, math.inf
INVALID = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
NOT_FOUND = frozenset({grpc.StatusCode.NOT_FOUND})
OVERSIZE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
UNIMPLEMENTED = frozenset({grpc.StatusCode.UNIMPLEMENTED})

SAMPLING_CASES: list[tuple[str, common_pb2.GenerateRequest]] = [
    ("empty-prompt", _gen(prompt_token_ids=[], sampling=_sp())),
    ("negative-max-tokens", _gen(sampling=_sp(max_tokens=-5))),
    ("zero-max-tokens", _gen(sampling=_sp(max_tokens=0))),
    ("nan-temperature", _gen(sampling=_sp(temperature=NAN))),
    ("inf-temperature", _gen(sampling=_sp(temperature=INF))),
    ("negative-temperature", _gen(sampling=_sp(temperature=-1.0))),
    ("nan-top-p", _gen(sampling=_sp(top_p=NAN))),
    ("zero-top-p", _gen(sampling=_sp(top_p=0.0))),
    ("top-k-below-minus-one", _gen(sampling=_sp(top_k=-7))),
    ("min-p-above-one", _gen(sampling=_sp(min_p=1.5))),
    ("negative-seed", _gen(sampling=_sp(seed=-1))),
    ("zero-repetition-penalty", _gen(sampling=_sp(repetition_penalty=0.0))),
    ("huge-presence-penalty", _gen(sampling=_sp(presence_penalty=1e30))),
    ("min-tokens-above-max", _gen(sampling=_sp(min_tokens=50, max_tokens=2))),
    ("negative-stop-token", _gen(sampling=_sp(stop_token_ids=[-4]))),
    ("n-zero", _gen(sampling=_sp(n=0))),
    ("n-huge", _gen(sampling=_sp(n=100_000))),
    ("logprobs-too-many", _gen(sampling=_sp(logprobs=1000))),
    ("prompt-logprobs-negative", _gen(sampling=_sp(prompt_logprobs=-1))),
    ("token-id-negative", _gen(prompt_token_ids=[1, -1], sampling=_sp())),
    ("token-id-out-of-vocab", _gen(prompt_token_ids=[1, VOCAB + 5], sampling=_sp())),
    ("token-id-int32-max", _gen(prompt_token_ids=[2**31 - 1], sampling=_sp())),
    ("prompt-over-context", _gen(prompt_token_ids=[5] * (MAX_MODEL_LEN + 10), sampling=_sp())),
    ("prompt-plus-max-tokens-over-context", _gen(prompt_token_ids=[5] * 2000, sampling=_sp(max_tokens=100))),
]


def _cases() -> list[Case]:
    # The worker's bad requests: GENERATE_STREAM_CASES (answered on the stream).
    cases: list[Case] = [
        # a route on Scheduler.RouteStream
        Case("scheduler-route-empty-request", "scheduler", _routed(common_pb2.GenerateRequest())),
        Case("scheduler-route-no-model", "scheduler", _routed(_gen(model="", sampling=_sp()))),
        Case("scheduler-route-empty-prompt", "scheduler", _routed(_gen(prompt_token_ids=[], sampling=_sp()))),
        Case(
            "scheduler-route-unknown-model",
            "scheduler",
            _routed(_gen(model="nope", sampling=_sp())),
            NOT_FOUND,
        ),
        Case(
            "scheduler-route-unknown-model-force-encode",
            "scheduler",
            _routed(_gen(model="nope"), exclude=["x"] * 100, force_encode=True),
            NOT_FOUND,
        ),
        Case(
            "worker-embed-on-decoder",
            "decoder-0",
            lambda ch: worker_pb2_grpc.WorkerStub(ch).Embed(
                common_pb2.EmbedRequest(inputs=["x"]), timeout=10
            ),
            UNIMPLEMENTED,
        ),
        Case(
            "scheduler-register-empty-worker",
            "scheduler",
            lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(), timeout=10
            ),
        ),
        Case(
            "scheduler-register-unknown-role",
            "scheduler",
            lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(
                    worker=scheduler_pb2.WorkerDescriptor(
                        worker_id="fuzz-w",
                        address="127.0.0.1:9",
                        role=99,  # no WorkerRole has this number
                        model="m",
                        block_size=16,
                        max_num_seqs=1,
                    )
                ),
                timeout=10,
            ),
        ),
        Case(
            "scheduler-register-zero-block-size",
            "scheduler",
            lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(
                    worker=scheduler_pb2.WorkerDescriptor(
                        worker_id="fuzz-w",
                        address="127.0.0.1:9",
                        role=worker_pb2.WORKER_ROLE_DECODER,
                        model="m",
                        block_size=0,
                        max_num_seqs=1,
                    )
                ),
                timeout=10,
            ),
        ),
        Case(
            "scheduler-heartbeat-no-worker-id",
            "scheduler",
            lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).Heartbeat(
                scheduler_pb2.HeartbeatRequest(), timeout=10
            ),
        ),
        # Tokenizer
        Case(
            "tokenizer-tokenize-unknown-model",
            "tokenizer",
            _tok("Tokenize", tokenizer_pb2.TokenizeRequest(model="nope", text="x")),
            NOT_FOUND,
        ),
        Case(
            "tokenizer-detokenize-out-of-vocab",
            "tokenizer",
            _tok("Detokenize", tokenizer_pb2.DetokenizeRequest(model=MODEL_NAME, token_ids=[10**6])),
        ),
        Case(
            "tokenizer-detokenize-negative",
            "tokenizer",
            _tok("Detokenize", tokenizer_pb2.DetokenizeRequest(model=MODEL_NAME, token_ids=[-1])),
        ),
        Case("tokenizer-render-chat-bad-json", "tokenizer", _render_chat("{not json")),
        Case("tokenizer-render-chat-empty-messages", "tokenizer", _render_chat("[]")),
        Case("tokenizer-render-chat-messages-not-list", "tokenizer", _render_chat('{"role": "user"}')),
        Case(
            "tokenizer-render-chat-unknown-role",
            "tokenizer",
            _render_chat('[{"role": "wizard", "content": "x"}]'),
        ),
        Case(
            "tokenizer-render-chat-content-number",
            "tokenizer",
            _render_chat('[{"role": "user", "content": 12}]'),
        ),
        Case("tokenizer-render-chat-tools-not-list", "tokenizer", _render_chat(tools_json='{"a": 1}')),
        Case(
            "tokenizer-render-chat-kwargs-not-object",
            "tokenizer",
            _render_chat(chat_template_kwargs_json="[1]"),
        ),
        Case(
            "tokenizer-render-chat-template-not-allowed", "tokenizer", _render_chat(chat_template="{{ 1 }}")
        ),
        Case("tokenizer-image-bad-base64", "tokenizer", _image_chat("data:image/png;base64,!!!!not-base64")),
        Case(
            "tokenizer-image-not-an-image", "tokenizer", _image_chat("data:image/png;base64,aGVsbG8gd29ybGQ=")
        ),
        Case("tokenizer-image-wrong-media-type", "tokenizer", _image_chat("data:text/plain;base64,aGVsbG8=")),
        Case("tokenizer-image-remote-url-refused", "tokenizer", _image_chat("http://127.0.0.1:9/cat.png")),
        Case("tokenizer-image-file-url-refused", "tokenizer", _image_chat("file:///etc/passwd")),
        Case(
            "tokenizer-get-tokenizer-unknown-model",
            "tokenizer",
            lambda ch: _stream(
                tokenizer_pb2_grpc.TokenizerStub(ch).GetTokenizer(
                    tokenizer_pb2.GetTokenizerRequest(model="nope"), timeout=CALL_TIMEOUT_S
                )
            ),
            NOT_FOUND,
        ),
        # Encoder cache
        Case("encoder-cache-put-empty-stream", "encoder-cache", _put()),
        Case("encoder-cache-put-no-meta", "encoder-cache", _put(encoder_cache_pb2.TensorChunk(data=b"x"))),
        Case(
            "encoder-cache-put-unknown-dtype",
            "encoder-cache",
            _put(encoder_cache_pb2.TensorChunk(meta=_meta(dtype="complex256"), data=b"\0" * 8)),
        ),
        Case(
            "encoder-cache-put-negative-shape",
            "encoder-cache",
            _put(encoder_cache_pb2.TensorChunk(meta=_meta(shape=(-2, -1), num_bytes=8), data=b"\0" * 8)),
        ),
        Case(
            "encoder-cache-put-size-mismatch",
            "encoder-cache",
            _put(encoder_cache_pb2.TensorChunk(meta=_meta(num_bytes=12), data=b"\0" * 12)),
        ),
        Case(
            "encoder-cache-put-short-data",
            "encoder-cache",
            _put(encoder_cache_pb2.TensorChunk(meta=_meta(), data=b"\0" * 4)),
        ),
        Case(
            "encoder-cache-put-extra-data",
            "encoder-cache",
            _put(
                encoder_cache_pb2.TensorChunk(meta=_meta(), data=b"\0" * 8),
                encoder_cache_pb2.TensorChunk(data=b"x"),
            ),
        ),
        Case(
            "encoder-cache-put-long-identifier",
            "encoder-cache",
            _put(encoder_cache_pb2.TensorChunk(meta=_meta(identifier="x" * 1000), data=b"\0" * 8)),
        ),
        Case(
            "encoder-cache-get-missing",
            "encoder-cache",
            lambda ch: _stream(
                encoder_cache_pb2_grpc.EncoderCacheStub(ch).Get(
                    encoder_cache_pb2.GetRequest(identifier="absent"), timeout=10
                )
            ),
            NOT_FOUND,
        ),
    ]
    return cases


CASES = _cases()


async def _run(address: str, call: Call) -> grpc.aio.AioRpcError | None:
    async with grpc.aio.insecure_channel(address, options=BIG_CHANNEL) as channel:
        try:
            await call(channel)
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


def _check(error: grpc.aio.AioRpcError | None, expect: frozenset[grpc.StatusCode]) -> None:
    assert error is not None, "the call succeeded; expected an error status"
    assert error.code() in expect, f"{error.code().name}: {error.details()}"
    assert error.details(), "error status without a message"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_message_is_a_client_error(mesh: RunningMesh, case: Case) -> None:
    """Each hostile message ends in its client-error status with a message."""
    _check(asyncio.run(_run(mesh.address(case.service), case.call)), case.expect)


def test_oversized_stream_chunk_is_resource_exhausted(mesh: RunningMesh) -> None:
    """One Put chunk over the limit → RESOURCE_EXHAUSTED (client-streaming path)."""
    chunk = encoder_cache_pb2.TensorChunk(meta=_meta(), data=b"\0" * (MAX_MESSAGE_BYTES + 1024))
    _check(asyncio.run(_run(mesh.address("encoder-cache"), _put(chunk))), OVERSIZE)


def test_encoder_cache_refuses_item_over_capacity_before_buffering(mesh: RunningMesh) -> None:
    """meta.num_bytes above the capacity is refused at the first chunk, not after the
    client streamed (and the server buffered) all of it."""
    total_mib = 4 * ENCODER_CACHE_MB
    sent = 0

    async def chunks() -> AsyncIterator[encoder_cache_pb2.TensorChunk]:
        nonlocal sent
        size = total_mib * 1024 * 1024
        yield encoder_cache_pb2.TensorChunk(meta=_meta(dtype="uint8", shape=(size,), num_bytes=size))
        for _ in range(total_mib):
            sent += 1
            yield encoder_cache_pb2.TensorChunk(data=b"\0" * (1024 * 1024))

    method = "EncoderCacheServicer._put"
    refused_before = mesh.rpc_count("encoder-cache", method, "INVALID_ARGUMENT")
    error = asyncio.run(
        _run(
            mesh.address("encoder-cache"),
            lambda ch: encoder_cache_pb2_grpc.EncoderCacheStub(ch).Put(chunks(), timeout=30),
        )
    )
    # The server's verdict, from its own metrics (the client may not see it, below).
    deadline = time.monotonic() + 5
    while mesh.rpc_count("encoder-cache", method, "INVALID_ARGUMENT") == refused_before:
        assert time.monotonic() < deadline, f"the server did not answer INVALID_ARGUMENT ({error})"
        time.sleep(0.05)
    # grpc-python's client reports INTERNAL "Internal error from Core" when the server's
    # status arrives while one of its writes is in flight (the failed write overwrites
    # the received status); any other outcome must be the INVALID_ARGUMENT itself.
    if error is None or "SendMessageOperation" not in (error.debug_error_string() or ""):
        _check(error, INVALID)
    assert sent < total_mib // 2, f"the server consumed {sent} of {total_mib} MiB before refusing"


def test_invalid_utf8_in_string_field_is_a_clean_error(mesh: RunningMesh) -> None:
    """Raw bytes with invalid UTF-8 in TokenizeRequest.text (a proto3 `string`): the server
    cannot parse the message; the call must fail with a message and the service survive."""
    payload = _field(1, MODEL_NAME.encode()) + _field(2, b"caf\xc3(\xff\xfe")
    error = asyncio.run(_run(mesh.address("tokenizer"), _raw("/meshserve.v1.Tokenizer/Tokenize", payload)))
    assert error is not None and error.code() is not grpc.StatusCode.OK
    assert "utf-8" in (error.details() or "").lower()
    assert mesh.alive("tokenizer")


@pytest.mark.parametrize(
    ("service", "method", "payload"),
    [
        ("tokenizer", "/meshserve.v1.Tokenizer/Tokenize", _field(2, b"\xff\xfe")),
        ("tokenizer", "/meshserve.v1.Tokenizer/RenderChat", _field(2, b"[\xc3(]")),
        ("scheduler", "/meshserve.v1.Scheduler/RouteStream", b"\xff\xff\xff\xff"),
        ("scheduler", "/meshserve.v1.Scheduler/RouteStream", _field(4, _field(1, b"lease-\xc3("))),
        ("decoder-0", "/meshserve.v1.Worker/Embed", _field(1, b"\x80\x80")),
    ],
    ids=["tokenize-utf8", "render-chat-utf8", "route-corrupt-wire", "release-utf8", "worker-utf8"],
)
def test_undecodable_message_is_invalid_argument(
    mesh: RunningMesh, service: str, method: str, payload: bytes
) -> None:
    """The contract asks for INVALID_ARGUMENT on a message that does not parse (on a
    stream: the call ends with it)."""
    if method.endswith("/RouteStream"):
        error = asyncio.run(_run(mesh.address(service), _raw_stream(method, payload)))
    else:
        error = asyncio.run(_run(mesh.address(service), _raw(method, payload)))
    _check(error, INVALID)


def test_release_takes_any_lease_ids(mesh: RunningMesh) -> None:
    """A release on the route stream never fails on what it is given: unknown, empty, huge
    or repeated lease ids are simply not released (0), a lease is released exactly once.
    Each release rides on a route, whose answer comes after the replica handled it."""

    async def run() -> list[float]:
        async with grpc.aio.insecure_channel(mesh.address("scheduler"), options=BIG_CHANNEL) as channel:
            routes = RouteClient(channel)
            leases: list[str] = []

            async def released_by(ids: list[str]) -> float:
                before = _released(mesh)
                release = scheduler_pb2.ReleaseRequest(lease_ids=ids)
                reply = await routes.route(_gen(request_id="", sampling=_sp()), timeout=10, release=release)
                leases.append(reply.lease_id)
                return _released(mesh) - before

            counts = [
                await released_by([]),
                await released_by([""]),
                await released_by(["no-such-lease", "x" * 100_000, "\u00e9\u0000\U0001f389"]),
                await released_by([f"unknown-{i}" for i in range(10_000)]),
            ]
            route = leases[-1]
            counts += [await released_by([route, route]), await released_by([route])]
            others = [lease for lease in leases if lease != route]
            before = _released(mesh)
            routes.release(*others)
            await routes.close()
            assert await asyncio.to_thread(_wait_released, mesh, before + len(others)) == before + len(others)
            return counts

    assert asyncio.run(run()) == [0, 0, 0, 0, 1, 0]


GENERATE_STREAM_CASES: list[tuple[str, common_pb2.GenerateRequest, frozenset[grpc.StatusCode]]] = [
    *((name, request, INVALID) for name, request in SAMPLING_CASES),
    ("no-request-id", _gen(request_id="", sampling=_sp()), INVALID),
    ("unknown-model", _gen(model="nope", sampling=_sp()), NOT_FOUND),
    (
        "mm-item-outside-prompt",
        _gen(
            sampling=_sp(),
            mm_items=[common_pb2.MultiModalItem(identifier="x", modality="image", offset=-5, length=10**9)],
        ),
        INVALID,
    ),
]


def test_bad_adds_on_generate_stream_fail_only_their_request(mesh: RunningMesh) -> None:
    """Every hostile add of GENERATE_STREAM_CASES on ONE GenerateStream is answered with
    a RequestError carrying its client-error code and a message, next to a valid request
    that runs to its end; aborts of unknown ids and empty messages are ignored; a second
    add of a running request id is refused while the first one finishes; afterwards the
    same stream still serves a request (the probe) and ends cleanly on half-close."""
    messages: list[worker_pb2.GenerateStreamRequest] = [
        worker_pb2.GenerateStreamRequest(add=_gen(request_id="fuzz-ok", sampling=_sp(max_tokens=8))),
        worker_pb2.GenerateStreamRequest(add=_gen(request_id="fuzz-ok", sampling=_sp())),
        worker_pb2.GenerateStreamRequest(abort=common_pb2.AbortRequest(request_id="fuzz-never-added")),
        worker_pb2.GenerateStreamRequest(abort=common_pb2.AbortRequest()),
        worker_pb2.GenerateStreamRequest(),
    ]
    for name, request, _expect in GENERATE_STREAM_CASES:
        bad = common_pb2.GenerateRequest()
        bad.CopyFrom(request)
        if bad.request_id:
            bad.request_id = f"fuzz-{name}"
        messages.append(worker_pb2.GenerateStreamRequest(add=bad))
    outcome = asyncio.run(_generate_stream(mesh.address("decoder-0"), messages))

    problems = []
    for name, request, expect in GENERATE_STREAM_CASES:
        request_id = f"fuzz-{name}" if request.request_id else ""
        error = outcome.error_of(request_id)
        if error is None:
            problems.append(f"{name}: no RequestError")
        elif error.code not in {int(code.value[0]) for code in expect} or not error.message:
            problems.append(f"{name}: code {error.code} {error.message!r}")
    assert not problems, problems
    duplicate = outcome.error_of("fuzz-ok")
    assert duplicate is not None and duplicate.code == int(grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert duplicate.param == "request_id"
    assert sorted(outcome.finished_ids()) == sorted([PROBE_ID, "fuzz-ok"])
    assert len(outcome.errors) == len(GENERATE_STREAM_CASES) + 1


def test_undecodable_message_on_generate_stream(mesh: RunningMesh) -> None:
    """Bytes that do not parse as a GenerateStreamRequest end the call with
    INVALID_ARGUMENT (never UNKNOWN/INTERNAL, never a hang); the worker goes on serving."""

    async def run() -> grpc.aio.AioRpcError | None:
        async with grpc.aio.insecure_channel(mesh.address("decoder-0")) as channel:
            stub = channel.stream_stream(
                "/meshserve.v1.Worker/GenerateStream",
                request_serializer=lambda b: b,
                response_deserializer=worker_pb2.GenerateStreamResponse.FromString,
            )

            async def requests() -> AsyncIterator[bytes]:
                yield b"\xff\xff\xff\xff"
                await asyncio.sleep(30)  # the server must end the call on its own

            try:
                await _stream(stub(requests(), timeout=CALL_TIMEOUT_S))
            except grpc.aio.AioRpcError as exc:
                return exc
        return None

    _check(asyncio.run(run()), INVALID)
    outcome = asyncio.run(_generate_stream(mesh.address("decoder-0"), []))
    assert outcome.finished_ids() == [PROBE_ID] and not outcome.errors


# ------------------------------------------------------------------ hypothesis-driven

_ints = st.one_of(st.integers(-(2**31), -1), st.integers(0, 4), st.integers(3000, 2**31 - 1))
_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def _sampling(draw: st.DrawFn) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams()
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if draw(st.booleans()):
            setattr(params, name, draw(_floats))
    for name in ("top_k", "min_tokens", "n", "logprobs", "prompt_logprobs"):
        if draw(st.booleans()):
            setattr(params, name, draw(_ints))
    if draw(st.booleans()):
        params.seed = draw(st.integers(-(2**63), 2**63 - 1))
    # Valid max_tokens stay tiny so accepted requests finish at once.
    params.max_tokens = draw(
        st.one_of(st.integers(1, 3), st.integers(-(2**31), 0), st.integers(2049, 2**31 - 1))
    )
    params.stop_token_ids.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3)))
    return params


_prompt = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2**31), 2**31 - 1)), max_size=12)
FUZZ_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)


def _acceptable(error: grpc.aio.AioRpcError | None) -> bool:
    return error is None or (error.code() in CLIENT_ERRORS and bool(error.details()))


def _request(prompt: list[int], sampling: common_pb2.SamplingParams, priority: int, salt: str) -> Any:
    return common_pb2.GenerateRequest(
        request_id="",
        model=MODEL_NAME,
        prompt_token_ids=prompt,
        sampling=sampling,
        priority=priority,
        cache_salt=salt,
    )


@FUZZ_SETTINGS
@given(
    prompt=_prompt,
    sampling=_sampling(),
    priority=st.integers(-(2**31), 2**31 - 1),
    salt=st.text(max_size=8),
    exclude=st.lists(st.text(max_size=8), max_size=3),
    force_encode=st.booleans(),
)
def test_fuzzed_route_never_fails_server_side(
    mesh: RunningMesh,
    prompt: list[int],
    sampling: common_pb2.SamplingParams,
    priority: int,
    salt: str,
    exclude: list[str],
    force_encode: bool,
) -> None:
    """Random routes: a lease (released at once, and counted released by the replica) or a
    client error, never INTERNAL/UNKNOWN."""
    before = _released(mesh)
    route = _routed(_request(prompt, sampling, priority, salt), exclude, force_encode)
    error = asyncio.run(_run(mesh.address("scheduler"), route))
    assert _acceptable(error), f"{error.code().name if error else ''}: {error.details() if error else ''}"
    if error is None:
        assert _wait_released(mesh, before + 1) == before + 1, "the route's lease was not released"


@FUZZ_SETTINGS
@given(
    requests=st.lists(
        st.tuples(_prompt, _sampling(), st.integers(-(2**31), 2**31 - 1), st.text(max_size=8)),
        min_size=1,
        max_size=4,
    )
)
def test_fuzzed_generate_stream_adds_never_fail_server_side(
    mesh: RunningMesh, requests: list[tuple[list[int], common_pb2.SamplingParams, int, str]]
) -> None:
    """Random adds on one GenerateStream: each request finishes or gets a RequestError
    with a client-error code and a message (never INTERNAL/UNKNOWN), and the stream still
    serves the probe afterwards."""
    messages = []
    for i, fields in enumerate(requests):
        request = _request(*fields)
        request.request_id = f"fuzz-{i}"
        messages.append(worker_pb2.GenerateStreamRequest(add=request))
    outcome = asyncio.run(_generate_stream(mesh.address("decoder-0"), messages))
    bad = [(e.request_id, e.code, e.message) for e in outcome.errors if e.code not in CLIENT_ERROR_NUMBERS]
    assert not bad, bad
    assert all(e.message for e in outcome.errors)
    ended = sorted([*outcome.finished_ids(), *(e.request_id for e in outcome.errors)])
    assert ended == sorted([PROBE_ID, *(f"fuzz-{i}" for i in range(len(requests)))])
    assert outcome.finished_ids()[-1] == PROBE_ID


@FUZZ_SETTINGS
@given(
    text=st.text(max_size=64),
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
)
def test_fuzzed_tokenizer_calls_never_fail_server_side(mesh: RunningMesh, text: str, ids: list[int]) -> None:
    """Random Tokenize / Detokenize / RenderChat inputs."""
    calls: list[Call] = [
        _tok("Tokenize", tokenizer_pb2.TokenizeRequest(model=MODEL_NAME, text=text, return_token_strs=True)),
        _tok("Detokenize", tokenizer_pb2.DetokenizeRequest(model=MODEL_NAME, token_ids=ids)),
        _render_chat(text),
    ]

    async def run_all() -> list[grpc.aio.AioRpcError | None]:
        return [await _run(mesh.address("tokenizer"), call) for call in calls]

    for error in asyncio.run(run_all()):
        assert _acceptable(error), f"{error.code().name if error else ''}: {error.details() if error else ''}"


def test_every_service_survived_the_fuzz(mesh: RunningMesh) -> None:
    """After all of the above: every process is alive, the mesh is healthy, no KV leaked,
    and a normal request still works."""
    dead = [name for name in mesh.procs if not mesh.alive(name)]
    assert not dead, f"crashed: {dead}"
    assert httpx.get(mesh.gateway_url + "/health", timeout=10).status_code == 200
    mesh.wait_kv_idle()
    reply = httpx.post(
        mesh.gateway_url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
