"""OpenTelemetry tracing with W3C trace context carried in gRPC metadata.

Off by default (`--tracing none`); `console` prints spans, `otlp` exports to
`--otlp-endpoint`, `memory` keeps them in-process for tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter

_TRACER_NAME = "meshserve"
_enabled = False
MEMORY_EXPORTER: SpanExporter | None = None


def setup_tracing(service: str, mode: str = "none", otlp_endpoint: str = "") -> None:
    """Installs a tracer provider for this process (no-op when mode is 'none')."""
    global _enabled, MEMORY_EXPORTER
    if mode == "none" or _enabled:
        # One provider per process: services sharing a process (tests) share it.
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter: SpanExporter
    if mode == "console":
        exporter = ConsoleSpanExporter()
    elif mode == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        MEMORY_EXPORTER = exporter
    else:
        exporter = _otlp_exporter(otlp_endpoint)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True


def _otlp_exporter(endpoint: str) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:  # optional dependency
        raise RuntimeError("tracing=otlp needs opentelemetry-exporter-otlp-proto-grpc installed") from exc
    return OTLPSpanExporter(endpoint=endpoint or None)  # type: ignore[no-any-return]


def tracer() -> trace.Tracer:
    return trace.get_tracer(_TRACER_NAME)


def inject_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata pairs (empty when tracing is off)."""
    if not _enabled:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


@contextlib.contextmanager
def server_span(name: str, context: grpc.aio.ServicerContext) -> Iterator[None]:
    """A server span for one RPC whose parent comes from the caller's metadata."""
    if not _enabled:
        yield
        return
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    parent = propagate.extract(carrier)
    token = otel_context.attach(parent)
    try:
        with tracer().start_as_current_span(name, kind=trace.SpanKind.SERVER):
            yield
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """An internal span (queueing, prefill, decode...); free when tracing is off."""
    if not _enabled:
        yield
        return
    with tracer().start_as_current_span(name, attributes=attributes):
        yield


class PhaseSpan:
    """A span opened and closed explicitly (e.g. prefill: submit → first token),
    a child of the span current at creation. No-op when tracing is off."""

    def __init__(self, name: str, **attributes: Any) -> None:
        self._span = tracer().start_span(name, attributes=attributes) if _enabled else None

    def end(self, **attributes: Any) -> None:
        if self._span is not None:
            if attributes:
                self._span.set_attributes(attributes)
            self._span.end()
            self._span = None


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
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()] if _enabled else []
