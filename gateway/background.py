"""Background responses (`POST /v1/responses` with `background: true`): generated apart
from any client connection, their events logged in the response store so that any
gateway replica serves them again, and produced on by another replica when the one
producing them dies.

`BackgroundResponses.launch` renders and admits the request while the client waits (bad
input and budgets answer as usual), stores the response `queued` with its `JobRecord`
(what any replica needs to produce it) and hands the rest to a task of this replica: it
runs the generation through the same chat and Responses stream translation as a streamed
response and logs each event with the output tokens that came since the previous one
(`ResponseStore.append_event`), keeps the stored object's status current (`in_progress`,
then the final one) and stops when a cancel is flagged. Any replica answers
`GET /v1/responses/{id}?stream=true&starting_after=N` from the log
(`ResponseStore.follow_events`) and `POST /v1/responses/{id}/cancel` by flagging the
cancel and waiting for the producer to record it (`cancel`).

Ownership: the producing replica holds a lease on the response in Redis (`LEASE_S`,
renewed every `RENEW_S`). Every replica sweeps the responses in progress (`SWEEP_S`); one
whose lease has lapsed (its replica died) is claimed by the first sweeper and adopted: the
logged tokens are replayed through a fresh translation -- they make the same events, the
logged ones are not logged again -- and the request goes on after them on a decoder, as a
mid-stream migration does. A follower sees no seam: no event lost or repeated. A sweep
never adopts what its own replica still produces, and a producer whose lease lapsed
unclaimed (its event loop stalled) takes it again; one whose lease another replica
claimed can log nothing more (`ResponseStore.append_event`'s fencing check) and stops.
Without Redis there is one replica and no adoption.

A background task counts as a request in flight for the gateway's drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from gateway import metrics
from gateway.chat import ChatStreamer, start_chat
from gateway.chat_bridge import named_event
from gateway.errors import APIError
from gateway.middleware import GatewayState
from gateway.multi_run import MultiRun
from gateway.protocol import ChatCompletionRequest
from gateway.response_store import END, ResponseStore, StoredResponse
from gateway.serving import RequestContext

__all__ = ["BackgroundResponses", "JobRecord", "Pipeline", "cancel"]

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.2  # how often the producer looks for a cancel flag
CANCEL_WAIT_S = 10.0  # how long a cancel waits for the producer to record it
LEASE_S = 3.0  # a producer's lease: lapses this long after its last renewal
RENEW_S = 1.0
SWEEP_S = 1.0  # how often each replica looks for responses whose producer died
LOG_RETRIES = 6  # a store call timing out under load is tried again for about 3 s
TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


class _LeaseLost(Exception):
    """Another replica holds the response's lease now: this production stops writing."""


@dataclass(frozen=True)
class JobRecord:
    """What any replica needs to produce a background response (stored beside it)."""

    tenant: str
    response_id: str
    request: dict[str, Any]  # the Responses request body
    chat: dict[str, Any]  # the chat request it became, its model resolved
    items: list[dict[str, Any]]  # the conversation before its output
    created_at: int

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), ensure_ascii=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> JobRecord:
        return cls(**json.loads(data))


class Pipeline(Protocol):
    """A job's translation: its chat request, the response object in a given state, and
    the Responses events of a started chat stream."""

    chat: ChatCompletionRequest

    def snapshot(self, status: str) -> dict[str, Any]: ...

    def events(self, chat: ChatStreamer) -> AsyncIterator[bytes]: ...


@dataclass
class _Stop:
    """Why a production's watcher stops it: "cancel", or "lost" (another replica claimed
    it); "" while it goes on."""

    reason: str = ""


@dataclass
class _Production:
    """One response being produced here: its job, translation, runs and where its log is."""

    job: JobRecord
    ctx: RequestContext
    pipeline: Pipeline
    multi: MultiRun
    logged: int = 0  # events already in the log (an adopted response's replay skips them)
    groups_sent: int = 0  # the run's output groups already in the log
    stop: _Stop = field(default_factory=_Stop)


class BackgroundResponses:
    """This replica's background responses (module docstring). ``pipeline_of`` builds a
    job's translation, ``context_of`` a request context for a tenant (adoption)."""

    def __init__(
        self,
        store: ResponseStore,
        state: GatewayState,
        pipeline_of: Callable[[JobRecord], Pipeline],
        context_of: Callable[[str], RequestContext],
    ) -> None:
        self.store, self.state = store, state
        self.pipeline_of, self.context_of = pipeline_of, context_of
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._tasks: set[asyncio.Task[None]] = set()
        # (owner, response id) -> the task producing it here: a sweep must not adopt
        # what this replica still produces (its lease may lapse while the loop stalls).
        self._producing: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts sweeping for responses to adopt (with a shared store)."""
        if self.store.shared and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def launch(self, job: JobRecord, ctx: RequestContext) -> dict[str, Any]:
        """Admits the job's request (APIError as a foreground one), stores it queued and
        starts producing it; the queued response object."""
        pipeline = self.pipeline_of(job)
        multi = await start_chat(ctx, pipeline.chat, pipeline.chat.model or "", job.response_id)
        try:
            queued = pipeline.snapshot("queued")
            await self.store.put(job.tenant, StoredResponse(queued, job.items))
            await self.store.begin_job(job.tenant, job.response_id, job.to_json(), self.me, LEASE_S)
        except BaseException:
            multi.close()
            raise
        self._spawn(_Production(job, ctx, pipeline, multi))
        metrics.BACKGROUND.labels(event="launched").inc()
        return queued

    def _spawn(self, production: _Production) -> None:
        self.state.enter()
        task = asyncio.get_running_loop().create_task(self._produce(production))
        self._tasks.add(task)
        key = (production.job.tenant, production.job.response_id)
        self._producing[key] = task
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda done: self._forget(key, done))

    def _forget(self, key: tuple[str, str], task: asyncio.Task[Any] | None) -> None:
        """``task`` no longer produces ``key`` here (ended, or its lease was lost)."""
        if self._producing.get(key) is task:
            del self._producing[key]

    def _lease_lost(self, key: tuple[str, str], task: asyncio.Task[Any] | None) -> None:
        """Another replica claimed ``key`` from ``task``: it stops here, and a later sweep
        may adopt the response again."""
        log.warning("background response %s: lease lost to another replica", key[1])
        self._forget(key, task)

    async def _produce(self, p: _Production) -> None:
        """Runs the generation, logging every event, until its end or a cancel."""
        from gateway.answers import StartedRequest

        owner, rid = p.job.tenant, p.job.response_id
        started = StartedRequest(p.ctx, rid, p.pipeline.chat.model or "", p.multi)
        streamer = ChatStreamer(started, p.pipeline.chat, "/v1/responses")
        watcher = asyncio.create_task(self._watch(owner, rid, p.stop, asyncio.current_task()))
        sequence = 0
        try:
            if not p.logged:
                await self.store.put(owner, StoredResponse(p.pipeline.snapshot("in_progress"), p.job.items))
            async for data in _until_stopped(p.pipeline.events(streamer), p.stop):
                if sequence >= p.logged:
                    await self._log(p, sequence, data)
                sequence += 1
            await self._ensure_final(p)
        except _LeaseLost:
            self._lease_lost((owner, rid), asyncio.current_task())
            return
        except asyncio.CancelledError:
            if p.stop.reason != "cancel":
                raise  # the gateway is stopping, or another replica took the response over
            metrics.BACKGROUND.labels(event="cancelled").inc()
            await self._record_end(p, p.pipeline.snapshot("cancelled"), "response.cancelled")
            return
        except Exception as exc:
            log.exception("background response %s failed", rid)
            message = exc.message if isinstance(exc, APIError) else f"internal error: {type(exc).__name__}"
            failed = p.pipeline.snapshot("failed") | {"error": {"code": "server_error", "message": message}}
            metrics.BACKGROUND.labels(event="failed").inc()
            await self._record_end(p, failed, "response.failed")
            return
        finally:
            watcher.cancel()
            p.multi.close()
            self.state.exit()
        await self._finish(p.job, max(sequence, p.logged))

    async def _log(self, p: _Production, sequence: int, data: bytes) -> None:
        """Logs one event with the output tokens that came since the previous one; a
        store error is retried (LOG_RETRIES, backing off) before the response fails."""
        owner, rid = p.job.tenant, p.job.response_id
        groups = p.multi.runs[0].groups
        fresh, p.groups_sent = groups[p.groups_sent :], len(groups)
        tokens = json.dumps(fresh).encode()
        for attempt in range(LOG_RETRIES):
            try:
                if not await self.store.append_event(owner, rid, sequence, data, self.me, tokens):
                    raise _LeaseLost
                return
            except APIError:
                with contextlib.suppress(APIError):
                    if await self.store.log_length(owner, rid) > sequence:
                        return  # it was written; only its reply was lost (a timeout)
                if attempt == LOG_RETRIES - 1:
                    raise
                await asyncio.sleep(0.1 * 2**attempt)

    async def _ensure_final(self, p: _Production) -> None:
        """A stream that ended on an error event leaves the response failed, not in progress."""
        found = await self.store.get(p.job.tenant, p.job.response_id)
        if found is None or found.response["status"] not in TERMINAL:
            failed = p.pipeline.snapshot("failed") | {
                "error": {"code": "server_error", "message": "generation failed"}
            }
            await self.store.put(p.job.tenant, StoredResponse(failed, p.job.items))

    async def _finish(self, job: JobRecord, sequence: int) -> None:
        """The end mark after the last event, and the job leaves the responses in progress."""
        with contextlib.suppress(APIError):
            if await self.store.append_event(job.tenant, job.response_id, sequence, END, holder=self.me):
                await self.store.end_job(job.tenant, job.response_id, self.me)

    async def _record_end(self, p: _Production, final: dict[str, Any], kind: str) -> None:
        """Stores ``final`` and logs its event after the last one logged (a cancel may
        have cut the producer off around a write), then ends the log (a store outage is
        logged)."""
        owner, rid = p.job.tenant, p.job.response_id
        with contextlib.suppress(APIError, _LeaseLost):
            await self.store.put(owner, StoredResponse(final, p.job.items))
            sequence = await self.store.log_length(owner, rid)
            await self._finish(p.job, await self._append_final(p.job, sequence, final, kind))

    async def _watch(self, owner: str, rid: str, stop: _Stop, generation: asyncio.Task[Any] | None) -> None:
        """Renews the lease and polls the cancel flag; on a cancel ("cancel") or when the
        lease was lost to another replica ("lost"), sets ``stop.reason`` and cancels
        ``generation`` (which also stops at its next event: `_until_stopped`)."""
        renewed = time.monotonic()
        while not stop.reason:  # flags and leases another replica may set: polled
            await asyncio.sleep(CANCEL_POLL_S)
            try:
                if await self.store.cancel_requested(owner, rid):
                    stop.reason = "cancel"
                elif time.monotonic() - renewed >= RENEW_S:
                    if not await self.store.renew_lease(owner, rid, self.me, LEASE_S):
                        self._lease_lost((owner, rid), generation)
                        stop.reason = "lost"
                    renewed = time.monotonic()
            except APIError:
                continue  # the store is down: the generation goes on
        if generation is not None:
            generation.cancel()

    # -- adoption -----------------------------------------------------------------------

    async def _sweep(self) -> None:
        """Adopts, every SWEEP_S, the responses in progress whose producer's lease lapsed."""
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                for owner, rid in await self.store.orphaned_jobs(self.me, LEASE_S):
                    if (owner, rid) not in self._producing:  # else the claim renewed our own lease
                        await self._adopt(owner, rid)
            except APIError:
                continue
            except Exception:
                log.exception("background responses: sweep failed")

    async def _adopt(self, owner: str, rid: str) -> None:
        """Produces on a response this replica has just claimed (module docstring)."""
        data = await self.store.job(owner, rid)
        found = await self.store.get(owner, rid)
        if data is None or found is None:
            await self.store.end_job(owner, rid, self.me)
            return
        job, entries = JobRecord.from_json(data), await self.store.read_log(owner, rid)
        log.warning(
            "background response %s: adopted after %d events (its replica stopped)", rid, len(entries)
        )
        metrics.BACKGROUND.labels(event="adopted").inc()
        if found.response["status"] in TERMINAL:  # it had ended: only its last events are missing
            with contextlib.suppress(_LeaseLost):
                await self._finish(job, await self._log_final(job, entries, found.response))
            return
        pipeline = self.pipeline_of(job)
        groups = [(int(i), list(ids)) for _data, fresh in entries for i, ids in json.loads(fresh or b"[]")]
        ctx = self.context_of(owner)
        request_id = f"{rid}-{uuid.uuid4().hex[:6]}"  # the lost run may still end on its worker
        multi = await start_chat(ctx, pipeline.chat, pipeline.chat.model or "", request_id)
        await multi.runs[0].replay(groups)
        self._spawn(_Production(job, ctx, pipeline, multi, logged=len(entries), groups_sent=len(groups)))

    async def _log_final(
        self, job: JobRecord, entries: list[tuple[bytes, bytes]], final: dict[str, Any]
    ) -> int:
        """Logs the final response's event unless the log ends with it (or an error event);
        the number of events logged then."""
        kind = f"response.{final['status']}"
        last = entries[-1][0] if entries else b""
        if last.startswith((f"event: {kind}\n".encode(), b"event: error\n")):
            return len(entries)
        return await self._append_final(job, len(entries), final, kind)

    async def _append_final(self, job: JobRecord, sequence: int, final: dict[str, Any], kind: str) -> int:
        """Logs the final response's event ``kind`` as event ``sequence``; the count logged then."""
        event = named_event(kind, {"type": kind, "sequence_number": sequence, "response": final})
        if not await self.store.append_event(job.tenant, job.response_id, sequence, event, holder=self.me):
            raise _LeaseLost
        return sequence + 1

    async def close(self) -> None:
        """Stops sweeping and the tasks still running (the gateway is stopping: another
        replica adopts what was in progress)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)


async def _until_stopped(events: AsyncIterator[bytes], stop: _Stop) -> AsyncIterator[bytes]:
    """``events`` until ``stop`` has a reason, then CancelledError: the watcher's cancel
    alone can be lost. Python 3.11's asyncio.wait_for (redis-py's socket writes, each
    logged event's) returns its inner call's result when a cancel arrives as that call
    ends, and the generation would go on to its end."""
    async for data in events:
        if stop.reason:
            raise asyncio.CancelledError
        yield data


async def cancel(store: ResponseStore, owner: str, record: StoredResponse) -> dict[str, Any]:
    """Flags a background response for cancelling and waits (up to CANCEL_WAIT_S) for its
    producer to record it; the response object then (a finished one unchanged)."""
    response = record.response
    if response["status"] in TERMINAL:
        return response
    await store.request_cancel(owner, response["id"])
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(CANCEL_POLL_S / 2)
        found = await store.get(owner, response["id"])
        if found is not None and found.response["status"] in TERMINAL:
            return found.response
    return response | {"status": "cancelled"}
