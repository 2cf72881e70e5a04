"""services.tracing in one process: the trace-context map helpers, PhaseSpan parents,
batching of console spans, no-ops when off, and the shutdown in run_service."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from typing import cast

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from meshserve.v1 import common_pb2
from services import tracing
from services.config import ProcessConfig
from services.server import run_service

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def no_tracing() -> Iterator[None]:
    """Each test starts and ends with no tracer provider (others may have left one)."""
    tracing.shutdown_tracing()
    yield
    tracing.shutdown_tracing()


def _memory() -> InMemorySpanExporter:
    tracing.setup_tracing("test", "memory")
    return cast(InMemorySpanExporter, tracing.MEMORY_EXPORTER)


def _by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_helpers_are_no_ops_when_tracing_is_off() -> None:
    request = common_pb2.GenerateRequest()
    with tracing.span("outer"):
        tracing.inject_into(request.trace_context)
    assert dict(request.trace_context) == {}
    with tracing.span_from("served", {"traceparent": PARENT}, request_id="r"):
        phase = tracing.PhaseSpan.from_carrier("phase", {"traceparent": PARENT})
        phase.child("child").end()
        phase.end()
    assert not tracing.enabled()
    assert tracing.inject_metadata() == [] and tracing.client_interceptors() == []


def test_map_carries_the_trace_to_a_server_span_and_its_phases() -> None:
    exporter = _memory()
    request = common_pb2.GenerateRequest(request_id="r1")
    with tracing.span("caller"):
        tracing.inject_into(request.trace_context)
    assert set(request.trace_context) == {"traceparent"}

    def serve() -> None:
        with tracing.span_from("served", request.trace_context, request_id="r1"):
            tracing.PhaseSpan("phase").end()

    contextvars.Context().run(serve)  # an empty context, as on the receiving side
    spans = _by_name(exporter)
    caller, served, phase = spans["caller"], spans["served"], spans["phase"]
    assert served.context.trace_id == caller.context.trace_id == phase.context.trace_id
    assert _parent_id(served) == caller.context.span_id and served.parent.is_remote  # type: ignore[union-attr]
    assert served.kind is trace.SpanKind.SERVER and served.attributes == {"request_id": "r1"}
    assert _parent_id(phase) == served.context.span_id


def test_empty_map_starts_a_new_trace_whatever_is_current() -> None:
    exporter = _memory()
    with tracing.span("stream"), tracing.span_from("served", {}):
        pass
    spans = _by_name(exporter)
    assert spans["served"].parent is None
    assert spans["served"].context.trace_id != spans["stream"].context.trace_id


def test_tracestate_travels_with_the_parent() -> None:
    exporter = _memory()
    carrier = {"traceparent": PARENT, "tracestate": "vendor=abc"}
    with tracing.span_from("served", carrier):
        again: dict[str, str] = {}
        tracing.inject_into(again)
    served = _by_name(exporter)["served"]
    assert served.context.trace_id == int(PARENT.split("-")[1], 16)
    assert again["tracestate"] == "vendor=abc"


def test_phase_span_from_carrier_and_child() -> None:
    exporter = _memory()
    served = tracing.PhaseSpan.from_carrier("served", {"traceparent": PARENT}, n=2)
    with tracing.span("unrelated"):
        child = served.child("decode")
    child.end(tokens=3)
    served.end()
    served.end()  # a second end does nothing
    spans = _by_name(exporter)
    assert _parent_id(spans["served"]) == int(PARENT.split("-")[2], 16)
    assert spans["served"].kind is trace.SpanKind.SERVER and spans["served"].attributes == {"n": 2}
    assert _parent_id(spans["decode"]) == spans["served"].context.span_id
    assert spans["decode"].attributes == {"tokens": 3}
    assert len(exporter.get_finished_spans()) == 3


def test_console_spans_are_batched_until_shutdown(capsys: pytest.CaptureFixture[str]) -> None:
    tracing.setup_tracing("test", "console")
    with tracing.span("batched.span"):
        pass
    assert "batched.span" not in capsys.readouterr().out
    tracing.shutdown_tracing()
    assert "batched.span" in capsys.readouterr().out
    assert not tracing.enabled()


async def test_flush_sends_queued_spans_and_keeps_tracing_on(capsys: pytest.CaptureFixture[str]) -> None:
    assert await tracing.flush_tracing()  # off: nothing to do
    tracing.setup_tracing("test", "console")
    with tracing.span("flushed.span"):
        pass
    assert await tracing.flush_tracing(timeout_s=5)
    assert "flushed.span" in capsys.readouterr().out
    assert tracing.enabled()


def test_run_service_shuts_tracing_down(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = _memory()

    async def main() -> None:
        with tracing.span("in.main"):
            pass

    # Its own thread: run_service runs (and closes) an event loop of its own.
    thread = threading.Thread(target=run_service, args=(main, ProcessConfig(uvloop=False)))
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert not tracing.enabled()
    assert [s.name for s in exporter.get_finished_spans()] == ["in.main"]
