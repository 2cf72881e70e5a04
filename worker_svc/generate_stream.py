"""One client's long-lived GenerateStream: many requests multiplexed, one message per
engine step (vLLM's engine → frontend batching). No grpc here.

The client (a gateway process) adds and aborts requests; each request's parallel samples
run as engine requests whose outputs arrive through `AsyncLLMEngine.submit` sinks. The
engine hands every output of one step to this loop in one callback, so the sender wakes
once per step and puts the new output of every request that is due into ONE
`GenerateStreamResponse`. `stream_interval` applies per request (`Outbox`): the first
tokens go at once (TTFT), then one message per `interval` tokens of a sequence, the end
at once.

A request-level failure (bad input, engine error) goes out as a `RequestError`; the
stream and its other requests go on. When the client goes away every request still
running is aborted, so its KV blocks are freed at once.

Everything here runs on the event loop, the sinks included: the engine thread only
hands over a step's `RequestOutput`s (vLLM's output processor pattern), and the
protobuf messages are built here, overlapping the engine's next forward.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from meshserve.v1 import common_pb2, worker_pb2
from services import tracing
from services.errors import (
    Aborted,
    Code,
    InvalidArgument,
    MeshError,
    NotFound,
    Unavailable,
    classify,
    status_number,
)
from services.kv_contract import request_extra_keys
from worker_svc import convert
from worker_svc import metrics as worker_metrics
from worker_svc.engine.async_engine import AsyncLLMEngine
from worker_svc.engine.engine import RequestOutput
from worker_svc.engine.multimodal import MultiModalInput
from worker_svc.engine.request import RequestSpec
from worker_svc.kv_connector import KvImporter, PrefillJob, TransferSource

log = logging.getLogger(__name__)

FetchMm = Callable[[common_pb2.GenerateRequest], Awaitable[list[MultiModalInput]]]


class Outbox:
    """The next message of one request: deltas gather here until it is due."""

    def __init__(self, request_id: str, interval: int) -> None:
        self.request_id = request_id
        self.interval = interval
        self.response = common_pb2.GenerateResponse(request_id=request_id)
        self._pending: dict[int, int] = {}

    def add(self, delta: common_pb2.SequenceDelta) -> None:
        self.response.deltas.append(delta)
        self._pending[delta.index] = self._pending.get(delta.index, 0) + len(delta.token_ids)

    def due(self, first: bool, finished: bool) -> bool:
        """Send now: the end, the first tokens (TTFT), or `interval` tokens of a sequence."""
        if finished:
            return True
        if not self.response.deltas:
            return False
        return first or max(self._pending.values()) >= self.interval

    def take(self) -> common_pb2.GenerateResponse:
        response = self.response
        self.response = common_pb2.GenerateResponse(request_id=self.request_id)
        self._pending.clear()
        return response


@dataclass(eq=False)
class RequestRun:
    """Output bookkeeping of one request (all its parallel samples)."""

    request: common_pb2.GenerateRequest
    child_ids: list[str]
    outbox: Outbox
    usage: common_pb2.Usage
    worker_id: str
    remaining: int = 0
    first: bool = True
    # worker.generate (parent: the caller's span, from request.trace_context) and its
    # current phase (worker.prefill: submit → first token, then worker.decode).
    span: tracing.PhaseSpan | None = None
    phase: tracing.PhaseSpan | None = None
    failed: bool = False
    prompt_logprobs_sent: bool = False

    def on_output(self, index: int, out: RequestOutput) -> None:
        """One sample's output of one engine step."""
        self.outbox.add(convert.sequence_delta(index, out))
        self.usage.completion_tokens += len(out.new_token_ids)
        # Every sample computes them and brings them with its first token: the message with
        # the request's first token carries them, whichever sample it is from.
        if out.prompt_logprobs and not self.prompt_logprobs_sent:
            self.prompt_logprobs_sent = True
            self.outbox.response.prompt_logprobs.extend(convert.prompt_logprobs(out))
        self.usage.cached_tokens = max(self.usage.cached_tokens, out.num_cached_tokens)
        if out.finished:
            self.remaining -= 1

    @property
    def finished(self) -> bool:
        return self.remaining <= 0

    def take_due(self) -> common_pb2.GenerateResponse | None:
        """The request's next message if it is due (see `Outbox.due`)."""
        if self.first and (self.outbox.response.deltas or self.finished):
            self.outbox.response.worker_id = self.worker_id
            self._next_phase()
        if self.finished:
            self.outbox.response.finished = True
            self.outbox.response.usage.CopyFrom(self.usage)
            self.end_spans()
        if not self.outbox.due(self.first, self.finished):
            return None
        self.first = False
        return self.outbox.take()

    def _next_phase(self) -> None:
        if self.phase is not None and self.span is not None:
            self.phase.end(cached_tokens=self.usage.cached_tokens)
            self.phase = self.span.child("worker.decode")

    def end_spans(self) -> None:
        """Ends the request's spans (idempotent)."""
        if self.phase is not None:
            self.phase.end(completion_tokens=self.usage.completion_tokens)
        if self.span is not None:
            self.span.end()


def transfer_source(request: common_pb2.GenerateRequest) -> TransferSource:
    """The request's `kv_source` as the connector takes it."""
    src = request.kv_source
    return TransferSource(src.worker_id, src.address, src.transfer_id, src.lease_id, src.expected_ms / 1000.0)


def request_error(request_id: str, exc: BaseException) -> worker_pb2.RequestError:
    """The RequestError for a request that failed with `exc` (logged when unexpected)."""
    code, message = classify(exc)
    if code is Code.INTERNAL:
        log.error("request %s failed: %r", request_id, exc)
    param = exc.param if isinstance(exc, MeshError) else None
    return worker_pb2.RequestError(
        request_id=request_id, code=status_number(code), message=message, param=param or ""
    )


@dataclass(eq=False)
class GenerateStreamCall:
    """The requests of one GenerateStream call and the messages it sends."""

    engine: AsyncLLMEngine
    worker_id: str
    model: str
    stream_interval: int
    fetch_mm: FetchMm | None
    draining: Callable[[], bool] = lambda: False
    # P/D: pulls a request's prompt KV from the prefill worker its route named.
    kv_importer: KvImporter | None = None
    runs: dict[str, RequestRun] = field(default_factory=dict, init=False)
    _ready: dict[str, RequestRun] = field(default_factory=dict, init=False)
    _errors: list[worker_pb2.RequestError] = field(default_factory=list, init=False)
    # Requests whose image embeddings are being fetched (not in the engine yet).
    _fetching: set[str] = field(default_factory=set, init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _input_done: bool = field(default=False, init=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    # -- requests in --------------------------------------------------------------

    def handle(self, message: worker_pb2.GenerateStreamRequest) -> None:
        """Applies one client message (add or abort)."""
        kind = message.WhichOneof("kind")
        if kind == "add":
            self.add(message.add)
        elif kind == "abort":
            self.abort(message.abort.request_id)

    def input_done(self) -> None:
        """The client half-closed: the stream ends once its requests have finished."""
        self._input_done = True
        self._wake.set()

    def add(self, request: common_pb2.GenerateRequest) -> None:
        """Starts a request, or queues a RequestError for it."""
        try:
            self._validate(request)
            if self.draining():
                raise Unavailable(f"worker {self.worker_id} is draining")
            if request.HasField("kv_source") and self.kv_importer is not None and not request.mm_items:
                self._fetching.add(request.request_id)  # as for images: see below
                self._spawn(self._add_pd(request, self.kv_importer))
                return
            if not request.mm_items:
                self._start(request, [])
                return
            if self.fetch_mm is None:
                raise Unavailable(
                    "this decoder worker has no encoder cache (encoder_cache_address), so it cannot take images"
                )
            # Marked now, not when the task runs: the id is taken, and a half-closed
            # stream must not end before the request has started.
            self._fetching.add(request.request_id)
            self._spawn(self._add_mm(request, self.fetch_mm))
        except Exception as exc:
            self._fail(request.request_id, exc)

    async def _add_mm(self, request: common_pb2.GenerateRequest, fetch: FetchMm) -> None:
        """Fetches the request's image embeddings, then starts it (unless aborted meanwhile)."""
        request_id = request.request_id
        error: Exception | None = None
        mm_inputs: list[MultiModalInput] = []
        try:
            mm_inputs = await fetch(request)
        except Exception as exc:
            error = exc
        if request_id not in self._fetching:  # aborted while fetching: already answered
            return
        self._fetching.discard(request_id)
        try:
            if error is not None:
                raise error
            self._start(request, mm_inputs)
        except Exception as exc:
            self._fail(request_id, exc)

    async def _add_pd(self, request: common_pb2.GenerateRequest, importer: KvImporter) -> None:
        """Pulls the prompt's KV from the prefill worker (`KvImporter`: on any failure it
        answers None and the request prefills here), then starts the request."""
        request_id = request.request_id
        source = transfer_source(request)
        span = tracing.PhaseSpan.from_carrier(
            "worker.kv_transfer",
            request.trace_context,
            request_id=request_id,
            prefill_worker=source.worker_id,
        )
        carrier: dict[str, str] = {}
        with span.current():  # the prefill worker's span is a child of this one
            tracing.inject_into(carrier)
        # A decoder sharing its prefix publishes the first num_prompt_tokens; this one
        # computes the rest (scheduler_svc/kv_share.py).
        shared = request.kv_source.num_prompt_tokens
        prompt = (
            request.prompt_token_ids[:shared]
            if 0 < shared < len(request.prompt_token_ids)
            else request.prompt_token_ids
        )
        job = PrefillJob(self.model, tuple(prompt), request.cache_salt, request.priority, carrier)
        try:
            import_id = await importer.fetch(source, job, request_extra_keys(request.cache_salt))
        finally:
            span.end()
        if request_id not in self._fetching:  # aborted meanwhile: already answered
            if import_id is not None:
                importer.discard(source, import_id)
            return
        self._fetching.discard(request_id)
        try:
            self._start(request, [], import_id)
        except Exception as exc:
            if import_id is not None:
                importer.discard(source, import_id)
            self._fail(request_id, exc)

    def _validate(self, request: common_pb2.GenerateRequest) -> None:
        if not request.request_id:
            raise InvalidArgument("request_id is required", param="request_id")
        if request.model and request.model != self.model and not self._lora_known(request.model):
            raise NotFound(f"model {request.model!r} is not served by this worker", param="model")
        if not request.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids must not be empty", param="prompt")
        if request.request_id in self.runs or request.request_id in self._fetching:
            raise InvalidArgument(f"request_id {request.request_id!r} is already running", param="request_id")
        convert.validate_mm_items(request)

    def _lora_known(self, name: str) -> bool:
        """Whether ``name`` is a LoRA adapter loaded on this worker (as of the engine's last step)."""
        state = self.engine.stats().lora
        return state is not None and name in state.loaded

    def _start(
        self,
        request: common_pb2.GenerateRequest,
        mm_inputs: list[MultiModalInput],
        kv_import_id: str | None = None,
    ) -> None:
        n = convert.num_samples(request.sampling)
        prompt = list(request.prompt_token_ids)
        info = self.engine.model_info
        resumed = convert.resumed_outputs(request.resumed, n)
        # Choices that ended before a migration are not run again.
        live = [i for i in range(n) if not (i in resumed and resumed[i].finished)]
        params = {
            i: convert.sampling_params(
                request.sampling, len(prompt), info.max_model_len, i, info.sampling_defaults
            )
            for i in live
        }
        all_ids = convert.child_ids(request.request_id, n)
        ids = [all_ids[i] for i in live]
        run = RequestRun(
            request,
            ids,
            Outbox(request.request_id, self.stream_interval),
            common_pb2.Usage(prompt_tokens=len(prompt)),
            self.worker_id,
            remaining=len(live),
        )
        run.span = tracing.PhaseSpan.from_carrier(
            "worker.generate", request.trace_context, request_id=request.request_id, n=n
        )
        run.phase = run.span.child("worker.prefill", prompt_tokens=len(prompt))
        # `model` naming an adapter runs the request under it (vLLM's convention).
        lora = request.model if request.model and request.model != self.model else ""
        keys = request_extra_keys(request.cache_salt, lora_name=lora)
        if lora:
            worker_metrics.LORA_REQUESTS.labels(lora).inc()
        self.runs[request.request_id] = run
        try:
            for index, child in zip(live, ids, strict=True):
                done = resumed[index].token_ids if index in resumed else ()
                sink = self._sink(run, index)
                spec = RequestSpec(
                    child,
                    prompt,
                    params[index],
                    priority=request.priority,
                    extra_keys=keys,
                    mm_inputs=mm_inputs,
                    resumed_output=done,
                    kv_import_id=kv_import_id,
                    lora_name=lora,
                )
                self.engine.submit(spec, sink)
                kv_import_id = None  # the first sample takes the imported blocks; the others hit them
        except Exception:
            self._drop(run)
            raise

    def _sink(self, run: RequestRun, index: int) -> Callable[[RequestOutput | BaseException], None]:
        def sink(item: RequestOutput | BaseException) -> None:
            if isinstance(item, BaseException):
                if not run.failed:  # one error per request, whichever sample failed first
                    run.failed = True
                    self._drop(run)
                    self._fail(run.request.request_id, item)
                return
            if run.request.request_id not in self.runs:
                return
            run.on_output(index, item)
            self._ready[run.request.request_id] = run
            self._wake.set()

        return sink

    def abort(self, request_id: str) -> None:
        """Aborts a request: its samples end with finish_reason ABORT, blocks freed."""
        if request_id in self._fetching:
            self._fetching.discard(request_id)
            self._fail(request_id, Aborted("aborted while its image embeddings were being fetched"))
            return
        run = self.runs.get(request_id)
        if run is None:
            return
        for child in run.child_ids:
            self.engine.abort(child)

    def _drop(self, run: RequestRun) -> None:
        run.end_spans()
        self.runs.pop(run.request.request_id, None)
        self._ready.pop(run.request.request_id, None)
        for child in run.child_ids:
            self.engine.abort(child, drop_output=True)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self._errors.append(request_error(request_id, exc))
        self._wake.set()

    # -- messages out -------------------------------------------------------------

    async def responses(self) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        """One message per wake-up (at most one per engine step) until the stream ends:
        the client half-closed, or the worker drains, and no request is left."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            message = self._collect()
            if message.outputs or message.errors:
                yield message
            if not self.runs and not self._fetching and (self._input_done or self.draining()):
                return

    def _collect(self) -> worker_pb2.GenerateStreamResponse:
        message = worker_pb2.GenerateStreamResponse(errors=self._errors)
        self._errors = []
        ready, self._ready = self._ready, {}
        for request_id, run in ready.items():
            response = run.take_due()
            if response is not None:
                message.outputs.append(response)
            if run.finished:
                self.runs.pop(request_id, None)
        return message

    def wake(self) -> None:
        """Re-checks the end condition (e.g. the worker started draining)."""
        self._wake.set()

    def close(self) -> None:
        """The call ended: abort every request still running (blocks freed at once)."""
        for run in list(self.runs.values()):
            self._drop(run)
        for task in self._tasks:
            task.cancel()

    def active_lease_ids(self) -> list[str]:
        """Leases of the requests running on this stream (for heartbeats)."""
        return [run.request.lease_id for run in self.runs.values() if run.request.lease_id]

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
