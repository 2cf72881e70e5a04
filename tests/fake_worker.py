"""The fake worker of the gateway and scheduler suites: a Worker gRPC servicer with no
model, whose answers come from a pluggable script.

GenerateStream runs each request added on the stream in a task of its own and sends the
outputs that are ready together (one message per "engine step"). A request is refused
with a `RequestError` when it has no request_id, names another model, has no prompt,
is already running or the worker is `draining`, or when its script refuses it. Each
step makes one token per unfinished choice: finish STOP (the script's stop token) once
the script's tokens run out, LENGTH at max_tokens (`tokens` when the request sets none);
the last message carries the usage (with `cached_tokens`). An abort ends the request
with a final FINISH_REASON_ABORT message (a plan's move: FINISH_REASON_MOVED). A migrated request's choices go on after the
tokens they already produced. Records every request added, every abort, the requests
completed and cancelled and the errors sent.

The script (`script`) is a callable that makes a `Plan` per request (or refuses it): the
plan says which tokens each choice produces, when the request fails or aborts by
itself and how long the worker pauses between steps (`delay` unless it says otherwise).
`counting_script` (the default; the scheduler suite's): token i of a request is
`(sum(prompt) + i) % 1000` and it never stops by itself. The gateway suite's
`KeywordScript` (tests/gateway/gateway_fakes.py) scripts text by prompt keywords.

Serving: `start()` serves the worker on its own gRPC server and, given a scheduler
address, registers it and heartbeats every 100 ms (load, `draining`, active leases;
`hang`, `resume`, `kill`); with a Redis URL each request's full prompt blocks go out as
KV events like the engine's. Or a harness serves it (the gateway suite's registers it
with its fake scheduler). Embed answers [len(text), 1.0] per input; `fail_first` makes
it fail UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from meshserve.v1 import (
    common_pb2,
    kv_transfer_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.errors import Code, status_number
from services.kv_contract import request_extra_keys
from services.kv_hash import block_hashes
from services.worker_roles import role_value
from worker_svc.kv_events import KvEventPublisher

HEARTBEAT_S = 0.1
# The alternatives of a top-logprobs list: token ids from here up (the gateway fake
# tokenizer's "x", "y", "z", ...).
FIRST_ALTERNATIVE = 130
ALTERNATIVES = 19


@dataclass(frozen=True)
class Refusal:
    """A request-level failure a script asks for: its status, message and the field at fault."""

    status: grpc.StatusCode
    message: str
    param: str = ""

    def error(self, request_id: str) -> worker_pb2.RequestError:
        """The RequestError the worker sends for `request_id`."""
        return worker_pb2.RequestError(
            request_id=request_id,
            code=status_number(Code(self.status.name)),
            message=self.message,
            param=self.param,
        )


class Plan:
    """How the worker runs one request: the default never fails, never aborts by itself
    and pauses the worker's `delay` between steps; a plan says at least which tokens each
    choice produces."""

    # The stop token a choice finishes with when its tokens run out.
    stop_token_id = 0

    def tokens(self, index: int) -> Iterable[int]:
        """The tokens choice `index` produces before it stops (endless: it never does)."""
        raise NotImplementedError

    def failure(self, position: int) -> Refusal | None:
        """The failure that ends the request after `position` tokens of choice 0, if any."""
        return None

    def aborts(self, position: int) -> bool:
        """Whether the worker aborts the request by itself after `position` tokens of choice 0."""
        return False

    def moves(self, position: int) -> bool:
        """Whether the worker ends the request as moved after `position` tokens of choice 0
        (as a P/D prefill worker does before a long prefill; never a resumed request)."""
        return False

    def pause_s(self, position: int, delay: float) -> float:
        """Seconds between the step that made `position` tokens of choice 0 and the next."""
        return delay


# A script: the plan for a request, or why the worker refuses it.
Script = Callable[[common_pb2.GenerateRequest], Plan | Refusal]


@dataclass
class CountingPlan(Plan):
    """Token i of the request is (base + i) % 1000, base the sum of its prompt; endless."""

    base: int

    def tokens(self, index: int) -> Iterable[int]:
        """Endless deterministic tokens (the same for every choice)."""
        return ((self.base + i) % 1000 for i in itertools.count())


def counting_script(request: common_pb2.GenerateRequest) -> Plan:
    """The deterministic script: token i is (sum(prompt) + i) % 1000, up to max_tokens."""
    return CountingPlan(sum(request.prompt_token_ids))


@dataclass
class KvEvent:
    """A KV event the worker publishes (what `KvEventPublisher` takes)."""

    kind: str
    block_hashes: list[int]


@dataclass
class _Choice:
    """One choice of a running request: its tokens, the next one, how many it made."""

    index: int
    tokens: Iterator[int]
    next: int | None
    position: int
    done: bool


@dataclass
class _Run:
    """One request running on a stream."""

    request: common_pb2.GenerateRequest
    plan: Plan
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass
class _Stream:
    """One GenerateStream call: its outbox (None ends the call) and its running requests."""

    outbox: asyncio.Queue[worker_pb2.GenerateStreamResponse | None] = field(default_factory=asyncio.Queue)
    runs: dict[str, _Run] = field(default_factory=dict)
    input_done: bool = False

    def send(self, **fields: Any) -> None:
        """Queues a GenerateStreamResponse with `fields` (outputs or errors)."""
        self.outbox.put_nowait(worker_pb2.GenerateStreamResponse(**fields))

    def ended(self, request_id: str) -> None:
        """A request ended: the call ends once half-closed with none left."""
        self.runs.pop(request_id, None)
        if self.input_done and not self.runs:
            self.outbox.put_nowait(None)


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass(eq=False)
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A scripted decoder (or embedding, encoder) worker; see the module docstring."""

    worker_id: str
    script: Script = counting_script
    model: str = "m"
    role: str = "decoder"
    # max_tokens of a request that sets none.
    tokens: int = 4
    # Seconds between two steps of a request (unless its plan says otherwise).
    delay: float = 0.005
    # cached_tokens of the usage on a request's last message.
    cached_tokens: int = 0
    block_size: int = 4
    max_num_seqs: int = 8
    redis_url: str = ""
    kv_layout: kv_transfer_pb2.KvLayout | None = None
    # Requests produce no token until aborted (or the worker is killed: failover tests).
    hold: bool = False
    # Adds are refused with UNAVAILABLE; the heartbeats say so.
    draining: bool = False
    # The first stream breaks (UNAVAILABLE) after this many messages, the worker stays up
    # (a connection reset); 0 = never.
    break_first_stream_after: int = 0
    # Embed fails UNAVAILABLE.
    fail_first: bool = False
    heartbeating: bool = True
    # Cleared: every request waits before its last step until it is set again.
    finish: asyncio.Event = field(default_factory=_set_event)
    # Lease ids the heartbeats report besides those of running requests.
    lease_ids: set[str] = field(default_factory=set)
    # More LoadStats fields the heartbeats report.
    reported: dict[str, Any] = field(default_factory=dict)
    # Every request added on any stream (refused ones too).
    requests: list[common_pb2.GenerateRequest] = field(default_factory=list)
    # Request ids of the requests run and the Embed calls, in order.
    started: list[str] = field(default_factory=list)
    # request_id -> lease_id of the running requests
    active: dict[str, str] = field(default_factory=dict)
    # Request ids of the abort messages received, in order.
    aborts: list[str] = field(default_factory=list)
    completed: set[str] = field(default_factory=set)
    # Requests that ended without finishing on their own (abort, failure, stream lost).
    cancelled: set[str] = field(default_factory=set)
    errors_sent: list[worker_pb2.RequestError] = field(default_factory=list)
    streams_opened: int = 0
    # Heartbeats the scheduler answered.
    beats: int = 0
    address: str = ""
    server: grpc.aio.Server | None = None

    def __post_init__(self) -> None:
        self.publisher = KvEventPublisher(self.redis_url, self.worker_id)
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._beaten = asyncio.Condition()

    # -- records ------------------------------------------------------------------

    @property
    def last_request(self) -> common_pb2.GenerateRequest:
        """The last request added on any stream."""
        return self.requests[-1]

    @property
    def aborted(self) -> set[str]:
        """Request ids aborted on a stream."""
        return set(self.aborts)

    def request_ids(self) -> list[str]:
        """Ids of the requests added, in order."""
        return [r.request_id for r in self.requests]

    def active_lease_ids(self) -> list[str]:
        """The leases the heartbeats report: `lease_ids` and those of running requests."""
        return sorted(self.lease_ids | {lease for lease in self.active.values() if lease})

    def prompt_hashes(
        self, token_ids: list[int], cache_salt: str = "", mm_ids: tuple[str, ...] = ()
    ) -> list[int]:
        """The block hashes this worker publishes for a prompt (same keys as the engine)."""
        items = [common_pb2.MultiModalItem(identifier=i, offset=n) for n, i in enumerate(mm_ids)]
        return block_hashes(token_ids, self.block_size, request_extra_keys(cache_salt, items))

    # -- serving and heartbeats ---------------------------------------------------

    async def start(self, scheduler_address: str | None = None) -> FakeWorker:
        """Serves on 127.0.0.1:<ephemeral> (registered with the scheduler when given)."""
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()
        self.publisher.start()
        if scheduler_address:
            await self.connect(scheduler_address)
        return self

    def descriptor(self) -> scheduler_pb2.WorkerDescriptor:
        """The WorkerDescriptor it registers with."""
        return scheduler_pb2.WorkerDescriptor(
            worker_id=self.worker_id,
            address=self.address,
            role=role_value(self.role),
            model=self.model,
            max_model_len=4096,
            block_size=self.block_size,
            num_total_blocks=1000,
            max_num_seqs=self.max_num_seqs,
            kv_layout=self.kv_layout,
        )

    async def connect(self, scheduler_address: str) -> None:
        """Registers and starts heartbeating every 100 ms (re-registering when unknown)."""
        self._channel = grpc.aio.insecure_channel(scheduler_address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        await self._stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=self.descriptor()))
        self._heartbeat = asyncio.create_task(self._beat(self._stub))

    async def _beat(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if not self.heartbeating:
                continue
            load = worker_pb2.LoadStats(num_running=len(self.active), num_total_blocks=1000, **self.reported)
            request = scheduler_pb2.HeartbeatRequest(
                worker_id=self.worker_id,
                load=load,
                draining=self.draining,
                active_lease_ids=self.active_lease_ids(),
            )
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await stub.Heartbeat(request)
                async with self._beaten:
                    self.beats += 1
                    self._beaten.notify_all()
                if not reply.known:
                    await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=self.descriptor()))

    async def wait_beats(self, count: int, timeout: float = 10.0) -> None:
        """Waits until `count` more heartbeats have been answered."""
        target = self.beats + count
        async with asyncio.timeout(timeout), self._beaten:
            await self._beaten.wait_for(lambda: self.beats >= target)

    def hang(self) -> None:
        """Stops heartbeating (a hung process: the server still accepts calls)."""
        self.heartbeating = False

    def resume(self) -> None:
        """Heartbeats again after `hang`."""
        self.heartbeating = True

    async def kill(self) -> None:
        """Stops serving and heartbeating at once (like kill -9)."""
        self.heartbeating = False
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        server, self.server = self.server, None
        if server is not None:
            # A second stop of a stopped aio server raises CancelledError: stop once.
            await server.stop(0)

    async def close(self) -> None:
        """Kills it, then closes its scheduler channel and KV event publisher."""
        await self.kill()
        if self._heartbeat is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._channel is not None:
            await self._channel.close()
        await asyncio.to_thread(self.publisher.close)

    # -- GenerateStream -----------------------------------------------------------

    async def GenerateStream(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Runs each request added, aborts those aborted; the outputs ready go together."""
        self.streams_opened += 1
        stream = _Stream()
        reader = asyncio.get_running_loop().create_task(self._read(request_iterator, stream))
        breaks_after = self.break_first_stream_after if self.streams_opened == 1 else 0
        sent = 0
        try:
            while (message := await stream.outbox.get()) is not None:
                if breaks_after and sent >= breaks_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (fake)")
                sent += 1
                while not stream.outbox.empty():  # whatever else is ready goes along
                    more = stream.outbox.get_nowait()
                    if more is None:
                        stream.outbox.put_nowait(None)
                        break
                    message.outputs.extend(more.outputs)
                    message.errors.extend(more.errors)
                yield message
        finally:
            reader.cancel()
            for run in list(stream.runs.values()):
                if run.task is not None:
                    run.task.cancel()

    async def _read(self, request_iterator: Any, stream: _Stream) -> None:
        """The stream's adds and aborts, until the caller half-closes it."""
        async for message in request_iterator:
            kind = message.WhichOneof("kind")
            if kind == "add":
                self._add(message.add, stream)
            elif kind == "abort":
                self.aborts.append(message.abort.request_id)
                run = stream.runs.get(message.abort.request_id)
                if run is not None:
                    run.aborted.set()
        stream.input_done = True
        if not stream.runs:
            stream.outbox.put_nowait(None)

    def _refusal(self, request: common_pb2.GenerateRequest, stream: _Stream) -> Refusal | None:
        """Why the worker itself refuses `request`, if it does."""
        if not request.request_id:
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required", "request_id")
        if request.model != self.model:
            return Refusal(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served", "model")
        if not request.prompt_token_ids:
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids must not be empty", "prompt")
        if request.request_id in stream.runs:
            message = f"request_id {request.request_id!r} is already running"
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, message, "request_id")
        if self.draining:
            return Refusal(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")
        return None

    def _add(self, request: common_pb2.GenerateRequest, stream: _Stream) -> None:
        """Records `request`, then refuses it or starts running it."""
        self.requests.append(request)
        plan = self._refusal(request, stream) or self.script(request)
        if isinstance(plan, Refusal):
            error = plan.error(request.request_id)
            self.errors_sent.append(error)
            stream.send(errors=[error])
            return
        run = stream.runs[request.request_id] = _Run(request, plan)
        run.task = asyncio.get_running_loop().create_task(self._run(run, stream))
        run.task.add_done_callback(lambda _task: stream.ended(request.request_id))

    async def _run(self, run: _Run, stream: _Stream) -> None:
        """Runs one request: its KV events, then its steps onto the stream."""
        request = run.request
        self.started.append(request.request_id)
        self.active[request.request_id] = request.lease_id
        if self.publisher.enabled:
            mm_ids = tuple(m.identifier for m in request.mm_items)
            hashes = self.prompt_hashes(list(request.prompt_token_ids), request.cache_salt, mm_ids)
            self.publisher.publish([KvEvent("stored", hashes)])
        try:
            if self.hold:
                await run.aborted.wait()
            async for item in self._steps(run):
                if isinstance(item, worker_pb2.RequestError):
                    self.errors_sent.append(item)
                    stream.send(errors=[item])
                    return
                if item.finished:  # recorded before the message can reach the caller
                    aborted = any(d.finish_reason == common_pb2.FINISH_REASON_ABORT for d in item.deltas)
                    (self.cancelled if aborted else self.completed).add(request.request_id)
                stream.send(outputs=[item])
                if item.finished:
                    return
        finally:
            self.active.pop(request.request_id, None)
            if request.request_id not in self.completed:
                self.cancelled.add(request.request_id)

    def _choices(self, run: _Run) -> list[_Choice]:
        """The request's choices; a migrated one's go on after the tokens they made."""
        sampling = run.request.sampling
        resumed = {r.index: r for r in run.request.resumed}
        choices = []
        for index in range(sampling.n if sampling.HasField("n") else 1):
            made = len(resumed[index].token_ids) if index in resumed else 0
            tokens = itertools.islice(run.plan.tokens(index), made, None)
            done = index in resumed and resumed[index].finished
            choices.append(_Choice(index, tokens, next(tokens, None), made, done))
        return choices

    async def _steps(self, run: _Run) -> AsyncIterator[common_pb2.GenerateResponse | worker_pb2.RequestError]:
        """The request's outputs, one per step, up to the finished one (or its failure)."""
        request, plan = run.request, run.plan
        choices = self._choices(run)
        first = True
        while not all(c.done for c in choices):
            position = choices[0].position
            failure = plan.failure(position)
            if failure is not None:
                yield failure.error(request.request_id)
                return
            if run.aborted.is_set() or plan.aborts(position):
                yield self._ended(request, choices, common_pb2.FINISH_REASON_ABORT)
                return
            if plan.moves(position) and not request.resumed:
                yield self._ended(request, choices, common_pb2.FINISH_REASON_MOVED)
                return
            deltas = [self._delta(request, plan, c) for c in choices if not c.done]
            response = common_pb2.GenerateResponse(request_id=request.request_id, deltas=deltas)
            if first:
                first = False
                response.worker_id = self.worker_id
                response.prompt_logprobs.extend(_prompt_logprobs(request))
            if all(c.done for c in choices):
                await self.finish.wait()
                response.usage.CopyFrom(self._usage(request, choices))
                response.finished = True
            yield response
            if response.finished:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.aborted.wait(), plan.pause_s(choices[0].position, self.delay))

    def _delta(
        self, request: common_pb2.GenerateRequest, plan: Plan, choice: _Choice
    ) -> common_pb2.SequenceDelta:
        """The choice's next token; STOP once its tokens ran out, LENGTH at max_tokens."""
        sampling = request.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else self.tokens
        token = choice.next
        assert token is not None, "a plan made no token for a choice"
        choice.next = next(choice.tokens, None)
        choice.position += 1
        delta = common_pb2.SequenceDelta(index=choice.index, token_ids=[token])
        if sampling.HasField("logprobs"):
            top = [common_pb2.TopLogprob(token_id=token, logprob=-0.25)]
            top += [
                common_pb2.TopLogprob(token_id=FIRST_ALTERNATIVE + k, logprob=-2.0 - k)
                for k in range(ALTERNATIVES)
            ]
            delta.logprobs.append(
                common_pb2.TokenLogprob(token_id=token, logprob=-0.25, top=top[: max(sampling.logprobs, 1)])
            )
        if choice.next is None:
            delta.finish_reason, delta.stop_token_id = common_pb2.FINISH_REASON_STOP, plan.stop_token_id
            choice.done = True
        elif choice.position >= max_tokens:
            delta.finish_reason, choice.done = common_pb2.FINISH_REASON_LENGTH, True
        return delta

    def _usage(self, request: common_pb2.GenerateRequest, choices: list[_Choice]) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=sum(c.position for c in choices),
            cached_tokens=self.cached_tokens,
        )

    def _ended(
        self, request: common_pb2.GenerateRequest, choices: list[_Choice], reason: int
    ) -> common_pb2.GenerateResponse:
        """The last message of a request aborted or moved: `reason` for every unfinished choice."""
        deltas = [
            common_pb2.SequenceDelta(index=c.index, finish_reason=reason) for c in choices if not c.done
        ]
        usage = self._usage(request, choices)
        return common_pb2.GenerateResponse(
            request_id=request.request_id, deltas=deltas, usage=usage, finished=True
        )

    # -- Embed --------------------------------------------------------------------

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """[len(text), 1.0] per input; UNAVAILABLE while `fail_first` is set."""
        self.started.append(request.request_id)
        if self.fail_first:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is broken")
        vectors = [common_pb2.Embedding(values=[float(len(text)), 1.0]) for text in request.inputs]
        return common_pb2.EmbedResponse(embeddings=vectors, prompt_tokens=len(request.inputs))


def _prompt_logprobs(request: common_pb2.GenerateRequest) -> list[common_pb2.TokenLogprob]:
    """Prompt logprobs when asked: every prompt token after the first, rank 1."""
    if not request.sampling.HasField("prompt_logprobs"):
        return []
    return [
        common_pb2.TokenLogprob(
            token_id=t, logprob=-0.5, rank=1, top=[common_pb2.TopLogprob(token_id=t, logprob=-0.5)]
        )
        for t in request.prompt_token_ids[1:]
    ]
