"""A hand-off's deadline on the decode side: past twice the estimate (+0.5 s) it is
abandoned when a local prefill would be sooner, kept while the decoder's own queue would
make a local prefill later, and never kept past the decoder's timeout.

The engine here only answers `stats()`: a decoder whose queue and prefill rate are set
exactly (a real one's measured rate varies from run to run)."""

from __future__ import annotations

import asyncio
import time

from worker_svc.engine.engine import EngineStats
from worker_svc.kv_connector import KvImporter


class _Stats:
    """An engine as `KvImporter._local_s` reads it: its latest step's snapshot."""

    def __init__(self, queued_prompt_tokens: int, prefill_tokens_per_s: float) -> None:
        self._stats = EngineStats(
            *(0,) * 11, queued_prompt_tokens=queued_prompt_tokens, prefill_tokens_per_s=prefill_tokens_per_s
        )

    def stats(self) -> EngineStats:
        return self._stats


def _importer(queued: int, rate: float, timeout_s: float = 10.0) -> KvImporter:
    return KvImporter(_Stats(queued, rate), connector=None, layout=None, timeout_s=timeout_s)  # type: ignore[arg-type]


async def _seconds_until_abandoned(importer: KvImporter, expected_s: float, work_s: float) -> float | None:
    """Seconds until the deadline abandoned a body of ``work_s`` seconds, None if it ran out."""
    started = time.monotonic()
    try:
        async with importer._deadline(expected_s, prompt_tokens=1000):
            await asyncio.sleep(work_s)
    except TimeoutError:
        return time.monotonic() - started
    return None


def test_an_idle_decoder_abandons_a_hand_off_past_its_deadline() -> None:
    # Local prefill: 1,000 tokens at 10,000/s = 0.1 s, sooner than the 0.2 s hand-off.
    waited = asyncio.run(_seconds_until_abandoned(_importer(0, 10_000.0), 0.2, work_s=3.0))
    assert waited is not None and 0.85 <= waited < 1.5  # 2 x 0.2 + 0.5


def test_a_busy_decoder_keeps_waiting_for_the_hand_off() -> None:
    # Local prefill: 20,000 queued + 1,000 tokens at 1,000/s = 21 s, later than the hand-off.
    waited = asyncio.run(_seconds_until_abandoned(_importer(20_000, 1_000.0), 0.2, work_s=2.0))
    assert waited is None


def test_the_decoders_timeout_bounds_the_wait() -> None:
    waited = asyncio.run(_seconds_until_abandoned(_importer(20_000, 1_000.0, timeout_s=1.5), 0.2, work_s=5.0))
    assert waited is not None and 1.4 <= waited < 2.2


def test_a_decoder_with_no_measured_rate_abandons_at_the_deadline() -> None:
    waited = asyncio.run(_seconds_until_abandoned(_importer(20_000, 0.0), 0.2, work_s=3.0))
    assert waited is not None and waited < 1.5


def test_no_estimate_waits_the_decoders_timeout() -> None:
    waited = asyncio.run(_seconds_until_abandoned(_importer(0, 10_000.0, timeout_s=1.0), 0.0, work_s=3.0))
    assert waited is not None and 0.95 <= waited < 1.6
