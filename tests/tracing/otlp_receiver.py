"""A real OTLP/gRPC trace receiver for tests, plus a helper that points this process's
tracing at it.

    async with otlp_receiver() as rx:          # grpc.aio server on 127.0.0.1:<free port>
        ...  # services export to rx.endpoint ("http://127.0.0.1:PORT")
        spans = await rx.wait_for(lambda s: any(r.name == "x" for r in s))

    async with otlp_receiver() as rx, otlp_tracing(rx):
        ...  # in-process services: spans go over OTLP to rx
        await tracing.flush_tracing()      # or leave the block: it flushes and shuts down
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from services import tracing


@dataclasses.dataclass(frozen=True)
class SpanRecord:
    """One received span. Ids are lowercase hex as in a W3C traceparent (trace 32
    digits, span 16); `parent_span_id` is "" for a root span."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    service: str  # the resource's service.name
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind (SERVER = 2)
    attributes: dict[str, Any]
    start_ns: int = 0  # unix nanoseconds
    end_ns: int = 0


def _value(value: common_pb2.AnyValue) -> Any:
    which = value.WhichOneof("value")
    return (
        getattr(value, which)
        if which in ("string_value", "bool_value", "int_value", "double_value")
        else None
    )


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def _records(request: trace_service_pb2.ExportTraceServiceRequest) -> list[SpanRecord]:
    records = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                records.append(_record(span, service))
    return records


def _record(span: trace_pb2.Span, service: str) -> SpanRecord:
    return SpanRecord(
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        service=service,
        kind=span.kind,
        attributes=_attributes(span.attributes),
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
    )


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Stores every span exported to it, in arrival order."""

    def __init__(self) -> None:
        self.port = 0
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._records: list[SpanRecord] = []
        self._arrived = asyncio.Condition()

    @property
    def endpoint(self) -> str:
        """The value for `--otlp-endpoint` / MESHSERVE_OTLP_ENDPOINT (plaintext)."""
        return f"http://127.0.0.1:{self.port}"

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        """The OTLP TraceService call: stores the spans, accepts them all."""
        async with self._arrived:
            self.requests.append(request)
            self._records.extend(_records(request))
            self._arrived.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[SpanRecord]:
        """The spans received so far."""
        return list(self._records)

    def clear(self) -> None:
        """Forgets the spans received so far."""
        self.requests.clear()
        self._records.clear()

    async def wait_for(
        self, predicate: Callable[[list[SpanRecord]], bool], timeout_s: float = 5.0
    ) -> list[SpanRecord]:
        """The spans once `predicate(spans)` holds; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        async with self._arrived:
            while not predicate(list(self._records)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({r.name for r in self._records})
                    raise TimeoutError(f"spans never matched within {timeout_s}s; got {names}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), left)
            return list(self._records)


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[OtlpReceiver]:
    """A running receiver on 127.0.0.1 (port chosen by the OS, no race); stopped on exit."""
    receiver = OtlpReceiver()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    receiver.port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield receiver
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def otlp_tracing(receiver: OtlpReceiver, service: str = "mesh") -> AsyncIterator[None]:
    """Points this process's tracing at `receiver` (replacing any provider set up by
    earlier tests) for the block; on exit flushes, shuts down and leaves tracing off.
    Enter it before starting in-process services or opening channels: their
    `setup_tracing` then keeps this provider, and channels pick up the interceptors."""
    # Blocking calls (a flush or shutdown may export to a receiver on this loop).
    await asyncio.to_thread(tracing.shutdown_tracing)
    tracing.setup_tracing(service, "otlp", receiver.endpoint)
    try:
        yield
    finally:
        await asyncio.to_thread(tracing.shutdown_tracing)
