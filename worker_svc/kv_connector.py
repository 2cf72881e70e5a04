"""The KV connector: how a decode worker gets a prompt's KV from a prefill worker.

`KVConnector` is the transport (gRPC today, `kv_grpc.py`; a NIXL or shared-memory one
could replace it on GPU hosts without touching the scheduler or the gateway):
``publish`` asks the prefill worker to compute and hold a prompt's KV, ``pull`` streams
the held blocks, ``release`` lets the prefill worker free them. Transport failures come
out as `KvTransferError` with a reason, never as transport exceptions.

`KvImporter` is the decode side's use of it (vLLM's connector scheduler half, folded
into one call): reserve the prompt's blocks in the engine, publish, check the layout,
pull, verify each chunk's checksums off the engine thread, import it into the reserved
blocks (hash checks there), and answer the import id the request then runs under.
Whatever fails, it answers None and the request prefills itself: the client sees no
error, the fallback is counted by reason. A hand-off running well past the scheduler's
estimate is abandoned the same way (`deadline`), unless this decoder's own queue would
make a local prefill no sooner. No grpc here.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from worker_svc import metrics
from worker_svc.engine.async_engine import AsyncLLMEngine
from worker_svc.engine.kv_transfer import KvBlockPayload, KvLayout, KvTransferError, verify_checksums

__all__ = ["KVConnector", "KvImporter", "PrefillJob", "PublishedTransfer", "TransferSource", "deadline"]

log = logging.getLogger(__name__)

# KV bytes handed to the engine and not yet imported before the pull waits for the oldest
# chunk: bounds the decode side's buffered KV while the engine is busy with a step. The
# engine imports every chunk queued at a step's end, so a whole prompt's KV within the
# bound lands at one step boundary (a count of 8 chunks made a pull wait 4 steps, seconds
# behind a long local prefill).
_IMPORT_BUFFER_BYTES = 64 << 20
# A hand-off gets OVERRUN times the scheduler's estimate plus OVERRUN_SLACK_S before the
# decoder prefills itself (docs/design-decisions.md, "P/D deadlines from estimates").
OVERRUN = 2.0
OVERRUN_SLACK_S = 0.5


def deadline(expected_s: float, timeout_s: float) -> float:
    """Seconds a hand-off estimated at ``expected_s`` (0: no estimate) may take, never
    more than the decoder's ``timeout_s``."""
    if expected_s <= 0.0:
        return timeout_s
    return min(timeout_s, expected_s * OVERRUN + OVERRUN_SLACK_S)


@dataclass(frozen=True)
class TransferSource:
    """The prefill worker that holds (or is to hold) a request's KV, and the hold's id."""

    worker_id: str
    address: str
    transfer_id: str
    lease_id: str = ""
    expected_s: float = 0.0  # the scheduler's estimate of the hand-off; 0: none


@dataclass(frozen=True)
class PrefillJob:
    """What the prefill worker computes: a text prompt with the request's cache salt."""

    model: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str = ""
    priority: int = 0
    trace_context: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PublishedTransfer:
    """A held transfer as its prefill worker describes it."""

    transfer_id: str
    layout: KvLayout
    block_hashes: tuple[int, ...]
    first_token_id: int
    num_cached_tokens: int = 0


class KVConnector(abc.ABC):
    """A transport for KV blocks between workers (see the module docstring)."""

    @abc.abstractmethod
    async def publish(self, source: TransferSource, job: PrefillJob) -> PublishedTransfer:
        """Has ``source``'s worker prefill ``job`` and hold its KV under the transfer id."""

    @abc.abstractmethod
    def pull(self, source: TransferSource, blocks_per_chunk: int) -> AsyncIterator[list[KvBlockPayload]]:
        """The held blocks in order, a few at a time; pulling to the end releases them."""

    @abc.abstractmethod
    async def release(self, source: TransferSource) -> None:
        """Lets the prefill worker free a transfer (best effort: its TTL frees it anyway)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Frees the transport's resources."""


@dataclass(eq=False)
class KvImporter:
    """A decode worker's hand-off: KV from a prefill worker into the engine, or None."""

    engine: AsyncLLMEngine
    connector: KVConnector
    layout: KvLayout
    timeout_s: float
    blocks_per_chunk: int = 4
    _releases: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    async def fetch(self, source: TransferSource, job: PrefillJob, extra_keys: tuple[str, ...]) -> str | None:
        """The import id the request's prompt KV was imported under, or None (fallback:
        the request prefills itself; counted by reason). Never raises, except on cancel."""
        import_id = f"import-{source.transfer_id}"
        prompt = job.prompt_token_ids
        started = 0.0  # set once the prefill worker is called
        try:
            # Room first: the prefill worker's work is never wasted for want of blocks.
            await self.engine.call(lambda engine: engine.kv.reserve_import(import_id, prompt, extra_keys))
            started = time.monotonic()
            async with self._deadline(source.expected_s, len(prompt)):
                published = await self.connector.publish(source, job)
                pulled_at = time.monotonic()
                mismatch = self.layout.mismatch(published.layout)
                if mismatch is not None:
                    raise KvTransferError("layout", f"prefill worker's KV layout differs: {mismatch}")
                count = await self._pull(source, import_id, prompt, extra_keys)
        except Exception as exc:
            reason = (
                exc.reason
                if isinstance(exc, KvTransferError)
                else "timeout"
                if isinstance(exc, TimeoutError)
                else "error"
            )
            if started:
                _observe_estimate(source, time.monotonic() - started)
            await self._fall_back(source, import_id, reason, exc)
            return None
        except asyncio.CancelledError:
            self._release_later(source, import_id)
            raise
        done = time.monotonic()
        _observe_estimate(source, done - started)
        tokens, seconds = count * self.layout.block_size, done - pulled_at
        # Not awaited: the request need not wait for the engine's next step to start.
        asyncio.ensure_future(
            self.engine.call(lambda engine: engine.kv.import_rate.add(tokens, seconds))
        ).add_done_callback(_consume)
        metrics.KV_TRANSFER_SECONDS.labels(phase="prefill").observe(pulled_at - started)
        metrics.KV_TRANSFER_SECONDS.labels(phase="pull").observe(done - pulled_at)
        metrics.KV_TRANSFERS.labels(outcome="imported").inc()
        log.debug("transfer %s: %d blocks imported", source.transfer_id, count)
        return import_id

    @contextlib.asynccontextmanager
    async def _deadline(self, expected_s: float, prompt_tokens: int) -> AsyncIterator[None]:
        """TimeoutError in the body once it runs past `deadline` and a prefill here would
        be done sooner than the whole hand-off was expected to take; checked again every
        ``expected_s`` until the decoder's ``timeout_s`` (docs/design-decisions.md, "P/D
        deadlines from estimates")."""
        loop = asyncio.get_running_loop()
        hard_stop = loop.time() + self.timeout_s
        timer: list[asyncio.TimerHandle] = []  # the pending check
        async with asyncio.timeout(None) as timeout:

            def check() -> None:
                now = loop.time()
                if now >= hard_stop or expected_s <= 0.0 or self._local_s(prompt_tokens) < expected_s:
                    timeout.reschedule(now)
                else:
                    timer[0] = loop.call_at(min(hard_stop, now + max(expected_s, 0.5)), check)

            timer.append(loop.call_later(deadline(expected_s, self.timeout_s), check))
            try:
                yield
            finally:
                timer[0].cancel()

    def _local_s(self, prompt_tokens: int) -> float:
        """Seconds this decoder expects to take to prefill a prompt of ``prompt_tokens``
        behind its queue (0: no rate measured yet)."""
        stats = self.engine.stats()
        rate = stats.prefill_tokens_per_s
        return (stats.queued_prompt_tokens + prompt_tokens) / rate if rate > 0.0 else 0.0

    def discard(self, source: TransferSource, import_id: str) -> None:
        """An import its request will never use (aborted meanwhile): unpin it."""
        self._release_later(source, import_id)

    async def _pull(
        self, source: TransferSource, import_id: str, prompt: tuple[int, ...], extra_keys: tuple[str, ...]
    ) -> int:
        layout = self.layout
        pending: list[tuple[asyncio.Future[Any], int]] = []
        buffered = count = 0
        try:
            async for payloads in self.connector.pull(source, self.blocks_per_chunk):
                await asyncio.to_thread(verify_checksums, payloads)
                size = sum(len(p.data) for p in payloads)
                metrics.KV_TRANSFER_BYTES.labels(direction="received").inc(size)

                def fn(engine: Any, chunk: list[KvBlockPayload] = payloads) -> int:
                    return int(
                        engine.kv.import_blocks(
                            import_id, layout, prompt, extra_keys, chunk, checksummed=True
                        )
                    )

                pending.append((asyncio.ensure_future(self.engine.call(fn)), size))
                buffered += size
                while buffered > _IMPORT_BUFFER_BYTES:
                    future, done = pending.pop(0)
                    count, buffered = await future, buffered - done
            while pending:
                count = await pending.pop(0)[0]
        finally:
            for future, _ in pending:  # an error or cancel above: nobody awaits the rest
                future.add_done_callback(_consume)
        return count

    async def _fall_back(
        self, source: TransferSource, import_id: str, reason: str, exc: BaseException
    ) -> None:
        log.warning(
            "transfer %s from %s: %s (%s; expected %.2f s); prefilling here",
            source.transfer_id,
            source.worker_id,
            reason,
            exc,
            source.expected_s,
        )
        metrics.KV_TRANSFERS.labels(outcome="fallback").inc()
        metrics.KV_TRANSFER_FALLBACKS.labels(reason=reason).inc()
        self._release_later(source, import_id)

    def _release_later(self, source: TransferSource, import_id: str) -> None:
        """Unpins whatever was imported (queued after every import call, so after them)
        and releases the prefill side, without holding up the request."""
        task = asyncio.ensure_future(self._release(source, import_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, source: TransferSource, import_id: str) -> None:
        try:
            await self.engine.call(lambda engine: engine.kv.release_import(import_id))
        except Exception as exc:  # engine shut down: nothing left to unpin
            log.debug("release of import %s: %r", import_id, exc)
        await self.connector.release(source)


def _observe_estimate(source: TransferSource, seconds: float) -> None:
    """How long a hand-off took against the scheduler's estimate (none: nothing to compare)."""
    if source.expected_s > 0.0:
        metrics.KV_HANDOFF_ESTIMATE_RATIO.observe(seconds / source.expected_s)


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
