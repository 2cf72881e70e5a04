"""OpenTelemetry tracing with W3C trace context carried in gRPC metadata or in a
request's `trace_context` map (requests multiplexed on one long-lived stream).

Off by default (`--tracing none`); `console` prints spans, `otlp` exports over OTLP/gRPC
to `--otlp-endpoint` (`http://host:4317` for plaintext, `https://...` for TLS), `memory`
keeps them in-process for tests. console and otlp batch spans in a background thread;
`flush_tracing` (on drain) and `shutdown_tracing` (at process exit) send what is queued.

One tracer provider per process: services sharing a process (tests) share it, named
after the first service that set it up. `shutdown_tracing` removes it, so a later
`setup_tracing` can install another one (e.g. a test switching from memory to otlp).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanProcessor,
)

log = logging.getLogger(__name__)

_TRACER_NAME = "meshserve"
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None
_global_set = False
MEMORY_EXPORTER: SpanExporter | None = None


def setup_tracing(service: str, mode: str = "none", otlp_endpoint: str = "") -> None:
    """Installs a tracer provider for this process (no-op when mode is 'none', or when
    one is installed already: the first service in a process names the provider)."""
    global _provider, _tracer, _global_set, MEMORY_EXPORTER
    if mode == "none":
        return
    if _provider is not None:
        log.debug("tracing already set up; %s keeps it (asked for %s)", service, mode)
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    processor: SpanProcessor
    if mode == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        MEMORY_EXPORTER = exporter
        # Simple: tests read spans right after they end, without a flush.
        processor = SimpleSpanProcessor(exporter)
    elif mode == "console":
        # sys.stdout as of now: the exporter's default is the one at its import.
        processor = BatchSpanProcessor(ConsoleSpanExporter(out=sys.stdout))
    else:
        processor = BatchSpanProcessor(_otlp_exporter(otlp_endpoint))
    provider.add_span_processor(processor)
    if not _global_set:
        # The API allows one global provider per process; meshserve code uses its own
        # reference (tracer()), so a replacement after shutdown_tracing still works.
        trace.set_tracer_provider(provider)
        _global_set = True
    _provider = provider
    _tracer = provider.get_tracer(_TRACER_NAME)


def _otlp_exporter(endpoint: str) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:  # optional dependency
        raise RuntimeError("tracing=otlp needs opentelemetry-exporter-otlp-proto-grpc installed") from exc
    if endpoint and "://" not in endpoint:
        # The exporter treats a bare host:port as TLS unless OTEL_EXPORTER_OTLP_INSECURE=true.
        log.warning(
            "otlp endpoint %r has no scheme: TLS unless OTEL_EXPORTER_OTLP_INSECURE=true; "
            "use http://%s for plaintext",
            endpoint,
            endpoint,
        )
    return OTLPSpanExporter(endpoint=endpoint or None)


def enabled() -> bool:
    """Whether a tracer provider is installed in this process."""
    return _provider is not None


def _flush(timeout_s: float) -> bool:
    provider = _provider
    if provider is None:
        return True
    return provider.force_flush(int(timeout_s * 1000))


async def flush_tracing(timeout_s: float = 5.0) -> bool:
    """Exports the spans queued so far (services call it when they drain); False when
    that took longer than `timeout_s` (the export goes on in the background).
    Runs in a thread: the export blocks, and its receiver may live on this loop (tests)."""
    try:
        # The SDK does not enforce force_flush's timeout for batch processors (1.45).
        return await asyncio.wait_for(asyncio.to_thread(_flush, timeout_s), timeout_s)
    except TimeoutError:
        return False


def shutdown_tracing() -> None:
    """Flushes and shuts the tracer provider down (process exit), then forgets it so a
    later `setup_tracing` installs a new one. Blocking: call it with no event loop
    running, or through `asyncio.to_thread`. No-op when tracing is off."""
    global _provider, _tracer, MEMORY_EXPORTER
    provider = _provider
    if provider is None:
        return
    _provider = None
    _tracer = None
    MEMORY_EXPORTER = None
    provider.shutdown()


def tracer() -> trace.Tracer:
    """This process's meshserve tracer (a no-op tracer when tracing is off)."""
    return _tracer if _tracer is not None else trace.NoOpTracer()


def inject_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata pairs (empty when tracing is off)."""
    if _provider is None:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def inject_into(carrier: MutableMapping[str, str]) -> None:
    """Writes the current trace context (W3C `traceparent`, `tracestate` when set) into
    `carrier`, e.g. `inject_into(request.trace_context)` on a GenerateRequest that
    travels on a shared stream. No-op when tracing is off or no span is current."""
    if _provider is None:
        return
    propagate.inject(carrier)


def _extract(carrier: Mapping[str, str]) -> otel_context.Context:
    # A fresh root context: a request without trace context starts its own trace rather
    # than becoming a child of whatever is current (e.g. a long-lived stream's span).
    return propagate.extract(dict(carrier), context=otel_context.Context())


@contextlib.contextmanager
def server_span(name: str, context: grpc.aio.ServicerContext) -> Iterator[None]:
    """A server span for one RPC whose parent comes from the caller's metadata."""
    if _provider is None:
        yield
        return
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    with span_from(name, carrier):
        yield


@contextlib.contextmanager
def span_from(name: str, carrier: Mapping[str, str], **attributes: Any) -> Iterator[None]:
    """A SERVER-kind span, current inside the block, whose parent is the trace context
    in `carrier` (what `inject_into` wrote; a new trace when it holds none). Spans,
    PhaseSpans and `inject_into` inside the block see it as their parent. Enter and
    leave it in the same task (one task per request). No-op when tracing is off."""
    if _provider is None:
        yield
        return
    token = otel_context.attach(_extract(carrier))
    try:
        with tracer().start_as_current_span(name, kind=trace.SpanKind.SERVER, attributes=attributes):
            yield
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """An internal span (queueing, prefill, decode...); free when tracing is off."""
    if _provider is None:
        yield
        return
    with tracer().start_as_current_span(name, attributes=attributes):
        yield


class PhaseSpan:
    """A span opened and closed explicitly (e.g. prefill: submit → first token),
    a child of the span current at creation (inside `span_from`, of that span).
    No-op when tracing is off."""

    def __init__(self, name: str, **attributes: Any) -> None:
        self._span: trace.Span | None = (
            tracer().start_span(name, attributes=attributes) if _provider is not None else None
        )
        self._ended = False

    @classmethod
    def _of(cls, span_: trace.Span | None) -> PhaseSpan:
        phase = cls.__new__(cls)
        phase._span = span_
        phase._ended = False
        return phase

    @classmethod
    def from_carrier(cls, name: str, carrier: Mapping[str, str], **attributes: Any) -> PhaseSpan:
        """A SERVER-kind PhaseSpan whose parent is the trace context in `carrier`: for
        code that serves many requests in one task and so cannot hold `span_from` open."""
        if _provider is None:
            return cls._of(None)
        kind = trace.SpanKind.SERVER
        return cls._of(tracer().start_span(name, context=_extract(carrier), kind=kind, attributes=attributes))

    def child(self, name: str, **attributes: Any) -> PhaseSpan:
        """A PhaseSpan whose parent is this one, whichever span is current."""
        if self._span is None:
            return PhaseSpan._of(None)
        parent = trace.set_span_in_context(self._span, otel_context.Context())
        return PhaseSpan._of(tracer().start_span(name, context=parent, attributes=attributes))

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Makes this span the current one inside the block (spans started there and the
        trace context sent from there take it as parent; an exception is recorded on it)
        without ending it: for a span that outlives the code that opened it."""
        if self._span is None:
            yield
            return
        with trace.use_span(self._span, end_on_exit=False):
            yield

    def end(self, **attributes: Any) -> None:
        """Ends the span (once; later calls do nothing), adding `attributes` first."""
        if self._span is None or self._ended:
            return
        if attributes:
            self._span.set_attributes(attributes)
        self._span.end()
        self._ended = True


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    extra = inject_metadata()
    if not extra:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *extra)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


# grpc.aio files an interceptor under the first of the four kinds it is an instance
# of, so each kind needs its own class.
class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return await continuation(_with_context(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return await continuation(_with_context(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, it: Any) -> Any:
        return await continuation(_with_context(details), it)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, it: Any) -> Any:
        return await continuation(_with_context(details), it)


def client_interceptors() -> list[Any]:
    """Interceptors that add the current trace context to every outgoing call's metadata."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()] if _provider is not None else []
