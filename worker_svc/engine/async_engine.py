"""asyncio front for :class:`LLMEngine`.

Threading model: the engine (all torch work) lives in ONE dedicated thread, so the
event loop never blocks on a forward pass; it is built on a short-lived thread of its
own, so that no other long-lived thread keeps an OpenMP pool (`_build_on_own_thread`).
The loop talks to it through a thread-safe
command queue (add / abort / stop); the engine thread sleeps on that queue while it has
no work and otherwise alternates "drain commands, step once". Outputs travel back with
``loop.call_soon_threadsafe`` -- one callback per loop per step, which hands every
request's output to its sink in that one callback: ``generate`` puts them on a
per-request ``asyncio.Queue``; ``submit`` callers (the worker's batched stream) get all
outputs of a step before they next run, so they can send one message per step. No
sink runs on the engine thread: what it hands over is plain ``RequestOutput``s, and the
loop turns them into messages while the engine runs its next forward.

Failure model: a failing step aborts the requests of that batch inside the engine and
raises in exactly those ``generate`` iterators; everything else keeps running. A
consumer that stops iterating (break, ``aclose``, cancellation) aborts its request,
which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from worker_svc.engine.block_manager import KvEvent
from worker_svc.engine.config import EngineConfig, resolved_thread_priority
from worker_svc.engine.engine import EngineStats, EngineStepError, LLMEngine, RequestOutput
from worker_svc.engine.model_runner import ModelInfo
from worker_svc.engine.request import RequestSpec

__all__ = ["AsyncLLMEngine", "EngineShutdownError"]

log = logging.getLogger(__name__)

_Item = RequestOutput | BaseException
Sink = Callable[[_Item], None]


class EngineShutdownError(RuntimeError):
    """The engine was shut down (or its thread died) before the request finished."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    # Called on the loop with each output (and the final one / an exception).
    deliver: Sink


@dataclass
class _Add:
    spec: RequestSpec  # validated by `submit`, its sequences copied
    stream: _Stream


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread between steps; its result resolves ``future``."""

    fn: Callable[[LLMEngine], Any]
    future: Future[Any]


@dataclass
class _Abort:
    request_id: str
    # Consumer went away: drop its stream so the abort notice is not delivered.
    drop_stream: bool


class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop
# A step's outputs by the event loop they go to.
_Batches = dict[asyncio.AbstractEventLoop, list[tuple["_Stream", _Item]]]

# How often an idle engine thread wakes to expire KV transfers nobody pulled.
_HELD_POLL_S = 1.0


def _build_on_own_thread(
    config: EngineConfig, on_kv_events: Callable[[list[KvEvent]], None] | None
) -> LLMEngine:
    """Builds the engine (model load, KV cache) on a thread that ends once it is built.

    Why: libgomp keeps an OpenMP thread pool for every thread that ever ran a parallel
    region, for as long as that thread lives. Built on the caller's thread (the main
    thread, an executor's), the engine leaves such a pool behind beside the engine
    thread's, libgomp then manages more threads than there are CPUs and cuts every
    barrier's spin to ~100 iterations (its "throttled" spin): the engine thread sleeps in
    a futex and is woken at almost every op of a forward. A pool of a thread that ended
    is freed (docs/design-decisions.md, "Torch work on one long-lived thread per process")."""
    # Leaving the `with` joins the executor's one thread: it has ended, its pool with it.
    with ThreadPoolExecutor(1, thread_name_prefix="meshserve-engine-build") as builder:
        return builder.submit(_build_and_warm_up, config, on_kv_events).result()


def _build_and_warm_up(
    config: EngineConfig, on_kv_events: Callable[[list[KvEvent]], None] | None
) -> LLMEngine:
    engine = LLMEngine(config, on_kv_events)
    if config.compiles:
        log.info("compiling the model's forward before reporting ready (minutes on a small CPU host)")
    seconds = engine.warm_up()
    if seconds:
        log.info("engine warmed up in %.1f s", seconds)
    log.info("engine: %s", engine.describe())
    return engine


def _lower_to_idle_priority() -> None:
    """Puts the calling thread in SCHED_IDLE. Threads it starts later inherit the policy
    -- the OpenMP workers libgomp creates at the thread's first parallel region among
    them -- so the whole forward yields its CPUs to any other thread at once
    (`resolved_thread_priority` says why). Linux lets any thread lower itself to it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux, or a seccomp profile forbids it
        log.warning("engine thread priority 'idle' not applied: %s", exc)


class AsyncLLMEngine:
    """Thread-backed asyncio wrapper: ``async for out in engine.generate(...)``."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        on_kv_events: Callable[[list[KvEvent]], None] | None = None,
        *,
        engine: LLMEngine | None = None,
    ) -> None:
        if engine is None:
            if config is None:
                raise ValueError("config is required when no engine is given")
            engine = _build_on_own_thread(config, on_kv_events)
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _closed + enqueueing, _active and _unseen
        self._closed = False
        self._active: set[str] = set()
        # Tokens to compute of the requests submitted that the latest snapshot does not
        # count yet (they reach the engine between two steps): `stats`.
        self._unseen: dict[str, int] = {}
        self._added: list[str] = []  # engine-thread owned: added since the last snapshot
        self._streams: dict[str, _Stream] = {}  # engine-thread owned
        # The latest step's outputs, handed over once the next forward is under way on the
        # GPU, or at once when no step follows (engine-thread owned; `_hold`).
        self._held: _Batches = {}
        engine.runner.on_forward = self._hand_over
        self._stats: EngineStats = engine.stats()

    @property
    def model_info(self) -> ModelInfo:
        """Static model facts (max_model_len, vocab_size, eos ids, ...)."""
        return self.engine.model_info

    def start(self) -> None:
        """Start the engine thread (idempotent; ``generate`` also starts it)."""
        with self._lock:
            if self._closed:
                raise EngineShutdownError("engine is shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="meshserve-engine", daemon=True)
                self._thread.start()

    def stats(self) -> EngineStats:
        """Snapshot taken by the engine thread after its latest step, its queued prompt
        tokens with those of the requests submitted since: a worker lists a request's lease
        as soon as it is submitted, and the scheduler then stops counting the route's tokens
        itself, while the step running then and the next one pass before a snapshot counts
        them (the engine takes requests in between steps)."""
        snapshot = self._stats
        with self._lock:
            unseen = sum(self._unseen.values())
        return (
            replace(snapshot, queued_prompt_tokens=snapshot.queued_prompt_tokens + unseen)
            if unseen
            else snapshot
        )

    def _send(self, command: _Command) -> None:
        with self._lock:
            if self._closed:
                raise EngineShutdownError("engine is shut down")
            self._commands.put(command)

    def submit(self, spec: RequestSpec, sink: Sink) -> None:
        """Submit a request whose outputs go to ``sink`` on the calling event loop.

        ``sink`` gets one ``RequestOutput`` per step that produced tokens for it, the
        last one ``finished``, or an exception; the outputs of one engine step for every
        request of this loop arrive in one loop callback. Invalid input raises ValueError
        before anything is scheduled. ``abort`` ends it early (a final "abort" output),
        ``abort(..., drop_output=True)`` silently. ``spec.transfer_id`` /
        ``spec.kv_import_id``: P/D hand-off, see `LLMEngine.add_request`.
        """
        self.engine.validate_request(spec)
        request_id = spec.request_id
        self.start()
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._active.add(request_id)
            self._unseen[request_id] = len(spec.prompt_token_ids) + len(spec.resumed_output)

        def deliver(item: _Item) -> None:
            if isinstance(item, BaseException) or item.finished:
                with self._lock:
                    self._active.discard(request_id)
            sink(item)

        stream = _Stream(asyncio.get_running_loop(), deliver)
        try:
            self._send(_Add(spec.copied(), stream))
        except BaseException:
            with self._lock:
                self._active.discard(request_id)
                self._unseen.pop(request_id, None)
            raise

    async def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield one output per step that produced tokens for it.

        Invalid input raises ValueError before anything is scheduled. Leaving the loop
        early (or cancellation) aborts the request.
        """
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.submit(spec, queue.put_nowait)
        done = False
        try:
            while not done:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:
                self.abort(spec.request_id, drop_output=True)

    def abort(self, request_id: str, drop_output: bool = False) -> bool:
        """Abort an in-flight request (thread-safe, non-blocking); False if it is not in flight.

        The engine thread frees its KV blocks before its next step, and the request's
        sink gets a final ``finish_reason="abort"`` output -- none with ``drop_output``
        (its consumer went away).
        """
        with self._lock:
            if self._closed or request_id not in self._active:
                return False
            if drop_output:
                self._active.discard(request_id)
            self._commands.put(_Abort(request_id, drop_stream=drop_output))
        return True

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps (the engine is not
        thread-safe: LoRA adapters, KV transfers change only there); returns its result or
        raises its exception. Calls queued together run in one go, in order."""
        future: Future[Any] = Future()
        self.start()
        self._send(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def shutdown(self) -> None:
        """Stop the engine thread; unfinished requests fail with EngineShutdownError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._commands.put(_Stop())
            thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)

    # ------------------------------------------------------ engine thread
    def _run(self) -> None:
        # Before the first forward: the thread's OpenMP pool, made then, inherits it.
        if resolved_thread_priority(self.engine.config) == "idle":
            _lower_to_idle_priority()
        try:
            while True:
                if not self._drain_commands(block=not self.engine.has_unfinished()):
                    break
                if self.engine.has_unfinished():
                    self._step()
                self._snapshot()
        except BaseException as exc:  # a bug in the loop itself: never leave consumers hanging
            log.exception("engine thread crashed")
            with self._lock:
                self._closed = True
            self._fail_all(EngineShutdownError(f"engine thread crashed: {exc!r}"))
            return
        self._fail_all(EngineShutdownError("engine is shut down"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once stopped."""
        commands: list[_Command] = []
        if block:
            self._hand_over()  # nothing may wait for a step that is not coming
            try:  # with transfers held, wake now and then to expire them (LLMEngine.step)
                commands.append(self._commands.get(timeout=_HELD_POLL_S if self.engine.kv.held else None))
            except queue.Empty:
                self.engine.kv.expire()
                return True
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for i, command in enumerate(commands):
            if isinstance(command, _Stop):
                for late in commands[i + 1 :]:  # never leave a caller waiting
                    if isinstance(late, _Call):
                        _fail_call(late, EngineShutdownError("engine is shut down"))
                return False
            if isinstance(command, _Add):
                self._handle_add(command)
            elif isinstance(command, _Call):
                _run_call(self.engine, command)
            else:
                self._handle_abort(command)
        return True

    def _snapshot(self) -> None:
        """The engine's counters after a step; the requests it took in before the step
        are in them now."""
        self._stats = self.engine.stats()
        if self._added:
            with self._lock:
                for request_id in self._added:
                    self._unseen.pop(request_id, None)
            self._added.clear()

    def _handle_add(self, cmd: _Add) -> None:
        self._added.append(cmd.spec.request_id)
        try:
            self.engine.add_request(cmd.spec, validated=True)  # by `submit`
        except ValueError as exc:
            self._post({cmd.stream.loop: [(cmd.stream, exc)]})
            return
        self._streams[cmd.spec.request_id] = cmd.stream

    def _handle_abort(self, cmd: _Abort) -> None:
        if cmd.drop_stream:
            self._streams.pop(cmd.request_id, None)
        self.engine.abort_request(cmd.request_id)

    def _step(self) -> None:
        steps = self.engine.num_steps
        try:
            outputs = self.engine.step()
        except EngineStepError as exc:
            log.error("engine step failed: %r", exc.cause)
            self._fail(exc.request_ids, exc.cause)
            return
        except Exception as exc:
            # Unknown engine state: abort everything rather than risk hanging requests.
            log.exception("engine step crashed; aborting all requests")
            ids = list(self.engine.requests)
            for request_id in ids:
                self.engine.abort_request(request_id)
            self._fail(ids, exc)
            return
        batches: _Batches = {}
        failed, self.engine.failed = self.engine.failed, []
        for request_id, cause in failed:  # e.g. a grammar that did not build: the request's error
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, cause))
        for out in outputs:
            stream = (
                self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            )
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, out))
        self._hold(batches, forward=self.engine.num_steps != steps)

    def _hold(self, batches: _Batches, forward: bool) -> None:
        """Where the forward runs on its own (CUDA: ``runner.launches_async``), keeps a
        step's outputs until the next step's forward is launched (``runner.on_forward``):
        handing them over wakes the event loop, whose thread then holds the GIL while it
        turns them into messages, and the next step's host work would wait for it while the
        GPU idles. Handed over at once elsewhere, after a step that ran no forward (a P/D
        worker's moved streams must not wait for the prefill chunk it moved them for), and
        when no step follows (docs/design-decisions.md, "Outputs handed over while the GPU
        runs"); and at once when the engine left a step in flight (async scheduling: these
        are the outputs of the step before it, read back after its launch)."""
        self._hand_over()  # the previous step's, where this one launched no forward
        self._held = batches
        engine = self.engine
        if not (
            forward and engine.runner.launches_async and engine.has_unfinished() and not engine.step_in_flight
        ):
            self._hand_over()

    def _hand_over(self) -> None:
        held, self._held = self._held, {}
        if held:
            self._post(held)

    def _fail(self, request_ids: list[str], cause: BaseException) -> None:
        self._hand_over()  # the previous step's outputs come before these errors
        batches: _Batches = {}
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                err = EngineStepError([request_id], cause)
                batches.setdefault(stream.loop, []).append((stream, err))
        self._post(batches)

    def _fail_all(self, exc: BaseException) -> None:
        self._hand_over()
        batches: _Batches = {}
        while True:  # commands nobody will run: their callers must not wait forever
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Call):
                _fail_call(command, exc)
            elif isinstance(command, _Add):
                batches.setdefault(command.stream.loop, []).append((command.stream, exc))
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        for stream in self._streams.values():
            batches.setdefault(stream.loop, []).append((stream, exc))
        self._streams.clear()
        self._post(batches)

    @staticmethod
    def _post(batches: _Batches) -> None:
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # loop closed: nobody is listening any more
                pass


def _fail_call(cmd: _Call, exc: BaseException) -> None:
    if cmd.future.set_running_or_notify_cancel():
        cmd.future.set_exception(exc)


def _run_call(engine: LLMEngine, cmd: _Call) -> None:
    if not cmd.future.set_running_or_notify_cancel():
        return
    try:
        cmd.future.set_result(cmd.fn(engine))
    except Exception as exc:  # the caller's error, not the engine thread's
        cmd.future.set_exception(exc)


def _deliver(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        try:
            stream.deliver(item)
        except Exception:  # one consumer's bug must not starve the others of this step
            log.exception("output sink failed")
