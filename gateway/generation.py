"""One generation: routed by the scheduler, run on the worker over the gateway's shared
stream to it, detokenized here.

Data flow of a `GenerationRun`:

* `events()` first asks the scheduler for a lease (a route on the replica's RouteStream:
  admission + routing), then adds the request to the gateway's `WorkerStream` to that
  worker;
* the stream's reader task hands each engine step's output to `on_output`, which
  detokenizes every choice in-process (UTF-8 safe, stop strings, `gateway.detokenizer`)
  and queues `ChoiceEvent`s; `events()` yields them. A stop string ends its choice
  with finish_reason "stop"; once every choice has ended early the request is aborted
  on the worker (KV blocks freed at once);
* failover: if the worker fails (stream lost, UNAVAILABLE, aborted by the server)
  before any token arrived, the run routes again with that worker excluded (up to
  `max_retries`); a decoder that finds its image embeddings evicted makes the scheduler
  encode again once;
* mid-stream migration: if it fails after tokens arrived, the run routes again (the
  worker excluded) and sends the prompt plus every choice's tokens so far
  (`GenerateRequest.resumed`); the new worker continues after them -- same seeded
  draws, same max_tokens budget -- and the choices' detokenizers go on where they
  were, so the client's stream shows no seam (up to `max_migrations` per request,
  then a 503). A worker that ends the request as moved (FINISH_REASON_MOVED: a P/D
  prefill worker before a long prefill) is left the same way, as no failure: it takes
  none of `max_migrations`. Once an attempt has failed, its later output is ignored:
  the next attempt resumes after what the client was sent;
* the lease goes back to the scheduler (batched on the route stream) when the request
  ends on its worker, fails over, migrates, or the run is closed.

A run's `RunState` is its request's lease lifecycle on this side; the lease is held
exactly while RUNNING, and every move out of RUNNING releases it:

    NEW --begin--> ROUTING --lease, added to the worker's stream--> RUNNING
    RUNNING --last message / refusal / stream lost--> ENDED
    RUNNING, ENDED --failover or migration--> ROUTING
    any but CLOSED --close()--> CLOSED (final)

`close()` is synchronous so it can run inside a cancelled scope: it aborts the
request on the worker if it is still running and releases the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum

from gateway import metrics
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import APIError, from_mesh_error
from gateway.local_tokenizer import LocalTokenizer
from gateway.upstream import TOKENIZER, LeaseGrant, Upstream
from gateway.worker_streams import WorkerStream
from meshserve.v1 import common_pb2, worker_pb2
from services import tracing
from services.errors import Code, MeshError, error_from_status

log = logging.getLogger(__name__)

# After an abort (stop string), how long to wait for the worker's final message (usage).
ABORT_DRAIN_S = 1.0

_FINISH_NAMES: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
}
# A sequence the worker ended this way did not finish: the request goes on elsewhere
# ("reroute", "move") or fails.
_UNFINISHED_RETRY = {
    common_pb2.FINISH_REASON_ABORT: "reroute",
    common_pb2.FINISH_REASON_ERROR: "",
    common_pb2.FINISH_REASON_MOVED: "move",
}


@dataclass(frozen=True)
class GenerationSpec:
    """Everything needed to run one prompt through the mesh."""

    request_id: str
    model: str
    prompt_ids: list[int]
    mm_items: list[common_pb2.MultiModalItem]
    sampling: common_pb2.SamplingParams
    n: int
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    priority: int
    tenant: str
    cache_salt: str = ""
    # The request's priority class (gateway/classes.py) and its longest wait in the
    # scheduler's queue (None: the scheduler's own; 0: never queued).
    service_class: str = "default"
    queue_timeout_s: float | None = None
    # The request field the output constraint came from (response_format, tool_choice,
    # structured_outputs.<kind>): a worker that refuses the constraint names this one.
    constraint_param: str = ""

    def generate_request(self) -> common_pb2.GenerateRequest:
        """The request as the scheduler routes it and the worker runs it."""
        return common_pb2.GenerateRequest(
            request_id=self.request_id,
            model=self.model,
            prompt_token_ids=self.prompt_ids,
            sampling=self.sampling,
            priority=self.priority,
            tenant=self.tenant,
            mm_items=self.mm_items,
            cache_salt=self.cache_salt,
            queue_timeout_s=self.queue_timeout_s,
        )


@dataclass
class ChoiceEvent:
    """New output of one choice: text, the tokens it came from, and maybe the end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Usage:
    """Token accounting of a finished run (prompt counted once, not per choice)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class _Choice:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    consumed: int = 0
    ended: bool = False
    completion_tokens: int = 0

    def consume(self, upto: int) -> tuple[list[int], list[common_pb2.TokenLogprob]]:
        """Tokens (and their logprobs) newly consumed by the detokenizer, up to `upto`."""
        upto = min(max(upto, self.consumed), len(self.token_ids))
        start, self.consumed = self.consumed, upto
        return self.token_ids[start:upto], self.logprobs[start:upto]


@dataclass
class _Failure:
    """The request failed upstream; `retry` says how it may go on before any output."""

    error: APIError
    # "" (give up), "reroute" (exclude the worker), "move" (exclude it, no failure) or "reencode"
    retry: str = ""


class RunState(Enum):
    """Where a `GenerationRun` is (module doc)."""

    NEW = "new"  # not begun
    ROUTING = "routing"  # asking the scheduler for a lease (first attempt, failover, migration)
    RUNNING = "running"  # the lease's worker runs the request: its last message is due
    ENDED = "ended"  # the worker sent its last message, refused the request, or its stream broke
    CLOSED = "closed"  # closed by its consumer: nothing more happens


_NEXT = {
    RunState.NEW: {RunState.ROUTING, RunState.CLOSED},
    RunState.ROUTING: {RunState.RUNNING, RunState.CLOSED},
    RunState.RUNNING: {RunState.ENDED, RunState.ROUTING, RunState.CLOSED},
    RunState.ENDED: {RunState.ROUTING, RunState.CLOSED},
    RunState.CLOSED: set(),
}


class _UpstreamDone:
    """The worker sent the request's last message (or it failed, or was forgotten)."""


_DONE = _UpstreamDone()


class GenerationRun:
    """Runs one GenerateRequest and yields per-choice `ChoiceEvent`s (see module doc)."""

    def __init__(self, upstream: Upstream, spec: GenerationSpec) -> None:
        self.upstream = upstream
        self.spec = spec
        self.worker_id = ""
        self._queue: asyncio.Queue[ChoiceEvent | _Failure | _UpstreamDone] = asyncio.Queue()
        # Events taken already and handed back (`hold`): `events` yields them first.
        self._held: deque[ChoiceEvent] = deque()
        self._choices: list[_Choice] = []
        self._tokenizer: LocalTokenizer | None = None
        self._lease: LeaseGrant | None = None
        self._stream: WorkerStream | None = None
        self._attempt_worker = ""
        self._excluded: list[str] = []
        self._force_encode = False
        self._attempts = 0
        self._migrations = 0
        self._attempt_failed = False  # a failure of the running attempt is queued
        self._state = RunState.NEW
        self._cached_tokens = 0
        self._deadline: asyncio.TimerHandle | None = None
        self.admitted = False  # a route has given it a lease (its tokens count for its tenant)
        # Each output message's tokens as they came, (choice, ids): replayed, they make
        # the same events again (`replay`; a background response's adoption).
        self.groups: list[tuple[int, list[int]]] = []
        # sampling.prompt_logprobs: the worker sends them with the first output.
        self.prompt_logprobs: list[common_pb2.TokenLogprob] | None = None

    @property
    def state(self) -> RunState:
        """Where the run is (module doc)."""
        return self._state

    def start(self) -> None:
        """Arms the run's deadline (routing starts with `events()`)."""
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.upstream.timeout, self._on_deadline)

    def _move(self, to: RunState) -> None:
        """Moves to `to` (one `_NEXT` does not allow is a bug); leaving RUNNING hands the
        lease back, so every way off a worker releases it."""
        if to not in _NEXT[self._state]:
            raise RuntimeError(f"{self.spec.request_id}: {self._state.value} -> {to.value}")
        if self._state is RunState.RUNNING and self._lease is not None:
            self.upstream.release(self._lease)
            self._lease = None
        self._state = to

    # -- routing and submission -----------------------------------------------------

    async def _get_tokenizer(self) -> LocalTokenizer:
        """The model's tokenizer (fetched from the tokenizer service once per model)."""
        try:
            return await self.upstream.tokenizers.get(self.spec.model)
        except MeshError as exc:
            raise from_mesh_error(exc, TOKENIZER) from exc

    def _ensure_choices(self) -> None:
        """One detokenizing `_Choice` per sample, made once the request is on its way
        to the worker (or when its first output comes, should that be sooner)."""
        if self._choices or self._tokenizer is None:
            return
        self._choices = [
            _Choice(
                i,
                self._tokenizer.detokenizer(
                    self.spec.prompt_ids,
                    self.spec.skip_special_tokens,
                    self.spec.stop,
                    self.spec.include_stop_str_in_output,
                ),
            )
            for i in range(self.spec.n)
        ]

    async def _submit(self) -> None:
        """Routes the request and adds it to the worker's stream (with the output so far)."""
        self._attempts += 1
        request = self.spec.generate_request()
        if self.prompt_logprobs is not None:  # a migration: the prompt is scored already
            request.sampling.ClearField("prompt_logprobs")
        request.resumed.extend(
            common_pb2.ResumedOutput(index=c.index, token_ids=c.token_ids, finished=c.ended)
            for c in self._choices
            if c.token_ids or c.ended
        )
        # The caller's span goes with the request: the scheduler's route span and the
        # worker's span are its children (both streams are shared by every request).
        tracing.inject_into(request.trace_context)
        lease = await self._route(request)
        if self._state is RunState.CLOSED:  # closed while routing: the lease is not used
            self.upstream.release(lease)
            return
        self._lease, self._attempt_worker = lease, lease.worker_id
        request.lease_id = lease.lease_id
        del request.mm_items[:]
        request.mm_items.extend(lease.mm_items)
        # the decoder pulls the KV itself (docs/features/prefill-decode-disaggregation.md)
        if lease.kv_source is not None:
            request.kv_source.CopyFrom(lease.kv_source)
        self._stream = self.upstream.workers.get(lease.worker_id, lease.worker_address)
        self._move(RunState.RUNNING)
        await self._stream.add(request, self)
        self.worker_id = lease.worker_id

    async def _route(self, request: common_pb2.GenerateRequest) -> LeaseGrant:
        """Route, excluding the workers that failed this run; when that leaves no worker,
        once more allowing them: a worker whose stream broke may well be alive (a reset
        connection), and one that is not still fails fast or is no longer listed."""
        labels = (self.spec.tenant, self.spec.service_class)
        started = time.perf_counter()
        try:
            try:
                lease = await self.upstream.route(request, self._excluded, self._force_encode)
            except APIError as exc:
                if exc.status != 503 or not self._excluded:
                    raise
                log.warning("%s: %s; routing again without exclusions", self.spec.request_id, exc.message)
                self._excluded = []
                lease = await self.upstream.route(request, [], self._force_encode)
        except APIError as exc:
            if exc.status == 429 and not self.admitted:
                metrics.ADMISSIONS.labels(*labels, "overloaded").inc()
            raise
        metrics.QUEUED.labels(*labels).observe(time.perf_counter() - started)
        if not self.admitted:
            self.admitted = True
            metrics.ADMISSIONS.labels(*labels, "admitted").inc()
        return lease

    # -- RequestSink: called by the worker stream's reader task -----------------------

    def on_output(self, response: common_pb2.GenerateResponse) -> None:
        """One engine step's output of this request: detokenize, queue events."""
        self._ensure_choices()
        if response.worker_id:
            self.worker_id = response.worker_id
        if response.prompt_logprobs and self.prompt_logprobs is None:
            self.prompt_logprobs = list(response.prompt_logprobs)
        if response.HasField("usage"):
            if self._lease is not None:  # the release tells the scheduler what was cached
                self.upstream.note_usage(self._lease, response.usage)
            if not self._migrations:
                # What the client's prompt found cached (a migrated run re-reads prompt + output).
                self._cached_tokens = response.usage.cached_tokens
        for delta in response.deltas:
            if 0 <= delta.index < len(self._choices) and not self._attempt_failed:
                self._on_delta(self._choices[delta.index], delta)
        if response.finished:
            self._upstream_ended()

    def _on_delta(self, choice: _Choice, delta: common_pb2.SequenceDelta) -> None:
        if choice.ended:
            return
        reason = delta.finish_reason
        if reason in _UNFINISHED_RETRY:
            # This run's own aborts drop the request's sink first: an abort that arrives
            # came from the worker (shutting down), so the request may go on elsewhere.
            self._attempt_failed = True
            self._queue.put_nowait(_Failure(_upstream_failure(reason), _UNFINISHED_RETRY[reason]))
            return
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs)
        if delta.token_ids:
            self.groups.append((choice.index, list(delta.token_ids)))
        step = choice.detok.push(delta.token_ids)
        ids, logprobs = choice.consume(step.num_tokens)
        event = ChoiceEvent(choice.index, step.text, ids, logprobs)
        if step.stopped:
            choice.ended = True
            choice.completion_tokens = choice.consumed
            event.finish_reason, event.stop_reason = "stop", step.matched_stop
        elif reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            event.text += choice.detok.finish()
            more_ids, more_logprobs = choice.consume(len(choice.token_ids))
            event.token_ids += more_ids
            event.logprobs += more_logprobs
            choice.ended = True
            choice.completion_tokens = len(choice.token_ids)
            event.finish_reason = _FINISH_NAMES[reason]
            if reason == common_pb2.FINISH_REASON_STOP and delta.HasField("stop_token_id"):
                event.stop_reason = delta.stop_token_id
        if event.text or event.token_ids or event.finish_reason:
            self._queue.put_nowait(event)

    def on_error(self, error: worker_pb2.RequestError) -> None:
        """The worker refused or failed the request."""
        self._upstream_ended()
        param = error.param
        if param == "structured_outputs" and self.spec.constraint_param:
            param = self.spec.constraint_param
        mesh_error = error_from_status(error.code, error.message, param)
        retry = {Code.UNAVAILABLE: "reroute", Code.FAILED_PRECONDITION: "reencode"}.get(mesh_error.code, "")
        api_error = from_mesh_error(mesh_error, "worker")
        self._queue.put_nowait(_Failure(api_error, retry))

    def on_stream_lost(self, reason: str) -> None:
        """The worker's stream broke: the worker is gone (or going)."""
        self._upstream_ended()
        message = f"worker {self._attempt_worker} failed: {reason}"
        self._queue.put_nowait(_Failure(APIError(503, message, code="unavailable"), "reroute"))

    def _upstream_ended(self) -> None:
        # Only the running attempt's end counts (a forgotten one's sink is dropped first).
        if self._state is RunState.RUNNING:
            self._move(RunState.ENDED)
            self._queue.put_nowait(_DONE)

    # -- the consumer side ------------------------------------------------------------

    async def begin(self) -> None:
        """Routes the request and puts it on the worker's stream (once; `events` calls it
        if nobody has); raises APIError when it cannot be routed."""
        if self._state is not RunState.NEW:
            return
        self._move(RunState.ROUTING)
        self._tokenizer = await self._get_tokenizer()
        await self._submit()
        self._ensure_choices()  # after the add: off the path to the worker

    async def replay(self, groups: list[tuple[int, list[int]]]) -> None:
        """Before it begins: the output of an earlier run of this request, as that run's
        `groups`: it comes out again as the same events, and the request then continues
        after it on a worker, as a migrated one does."""
        if self._state is not RunState.NEW:
            raise RuntimeError(f"{self.spec.request_id}: replay after the run began")
        self._tokenizer = await self._get_tokenizer()
        self._ensure_choices()
        for index, ids in groups:
            if 0 <= index < len(self._choices):
                self._on_delta(self._choices[index], common_pb2.SequenceDelta(index=index, token_ids=ids))

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Per-choice events until every choice has ended; raises APIError on failure."""
        await self.begin()
        # Counted on this side: `on_output` marks a choice ended before its last event
        # has been taken from the queue.
        unfinished = self.spec.n
        while unfinished or self._held:
            if self._held:
                yield self._held.popleft()
                continue
            item = await self._queue.get()
            if isinstance(item, ChoiceEvent):
                unfinished -= item.finish_reason is not None
                yield item
            elif isinstance(item, _Failure):
                await self._on_failure(item)
        await self._finish_upstream()

    def hold(self, event: ChoiceEvent) -> None:
        """Hands back an event `events` yielded: it yields it again, before any other
        (a peek before the response starts, without a buffering layer on every token)."""
        self._held.append(event)

    async def _on_failure(self, failure: _Failure) -> None:
        """Routes again (or migrates) when the request may go on elsewhere; raises otherwise."""
        if self._state is RunState.CLOSED or failure.error.status == 504:
            raise failure.error
        received = sum(len(c.token_ids) for c in self._choices)
        may_retry = not received and self._attempts <= self.upstream.config.max_retries
        if failure.retry == "reencode" and may_retry and not self._force_encode:
            self._force_encode = True
            metrics.REROUTES.labels(reason="reencode").inc()
        elif failure.retry == "reroute" and may_retry:
            self._excluded.append(self._attempt_worker)
            metrics.REROUTES.labels(reason="worker_failed").inc()
            log.warning("%s: %s; routing again", self.spec.request_id, failure.error.message)
        elif failure.retry == "reroute" and received:
            self._migrate(failure, received)
        elif failure.retry == "move":
            self._excluded.append(self._attempt_worker)
            metrics.MIGRATIONS.labels(outcome="moved").inc()
            log.debug("%s: %s after %d tokens", self.spec.request_id, failure.error.message, received)
        else:
            raise failure.error
        self._abandon_attempt()
        await self._submit()

    def _migrate(self, failure: _Failure, received: int) -> None:
        """Counts a mid-stream migration, or raises when the request may not move again."""
        limit = self.upstream.config.max_migrations
        if self._migrations >= limit:
            metrics.MIGRATIONS.labels(outcome="limit_reached").inc()
            error = failure.error
            raise APIError(
                error.status,
                f"{error.message} after {received} tokens; not migrated (max_migrations={limit} reached)",
                code=error.code,
            )
        self._migrations += 1
        self._excluded.append(self._attempt_worker)
        metrics.MIGRATIONS.labels(outcome="migrated").inc()
        log.warning(
            "%s: %s after %d tokens; migrating (%d/%d)",
            self.spec.request_id,
            failure.error.message,
            received,
            self._migrations,
            limit,
        )

    def _abandon_attempt(self) -> None:
        """Drops what is left of a failed attempt (its late messages are ignored); the
        next attempt routes."""
        self._forget()
        self._move(RunState.ROUTING)
        self._queue = asyncio.Queue()
        self._attempt_failed = False

    async def _finish_upstream(self) -> None:
        """Every choice ended: abort generation still running, wait briefly for usage."""
        if self._state is not RunState.RUNNING or self._stream is None:
            return
        self._stream.abort(self.spec.request_id)
        try:
            async with asyncio.timeout(ABORT_DRAIN_S):
                while not isinstance(await self._queue.get(), _UpstreamDone):
                    pass
        except TimeoutError:
            self.close()

    def _on_deadline(self) -> None:
        self._queue.put_nowait(
            _Failure(APIError(504, f"request timed out after {self.upstream.timeout:g}s (request_timeout_s)"))
        )

    def _forget(self) -> None:
        """Aborts the request on the worker, dropping whatever it still sends."""
        if self._state is RunState.RUNNING and self._stream is not None:
            self._stream.forget(self.spec.request_id)

    def usage(self) -> Usage:
        """Usage of the run; completion tokens are those each choice consumed."""
        completion = sum(c.completion_tokens for c in self._choices)
        return Usage(len(self.spec.prompt_ids), completion, self._cached_tokens)

    def completion_tokens_so_far(self) -> int:
        """Tokens consumed so far over all choices (continuous usage stats)."""
        return sum(c.completion_tokens if c.ended else c.consumed for c in self._choices)

    def close(self) -> None:
        """Aborts the request if it still runs and releases its lease (idempotent, sync)."""
        if self._state is RunState.CLOSED:
            return
        if self._deadline is not None:
            self._deadline.cancel()
        self._forget()
        self._move(RunState.CLOSED)


def _upstream_failure(reason: int) -> APIError:
    if reason == common_pb2.FINISH_REASON_ABORT:
        return APIError(503, "worker: the request was aborted by the server", code="aborted")
    if reason == common_pb2.FINISH_REASON_MOVED:
        return APIError(503, "worker: the request was moved to another worker", code="moved")
    return APIError(500, "worker: generation failed inside the serving stack", code="internal")
