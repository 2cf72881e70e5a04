"""Several GenerationRuns (one per prompt) seen as one: their events fanned in, their
budget reserved and settled, their usage summed (and as OpenAI's usage object)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from gateway import metrics
from gateway.budgets import Reservation, TenantBudgets
from gateway.errors import APIError
from gateway.generation import ChoiceEvent, GenerationRun, Usage
from gateway.protocol import PromptTokensDetails, UsageInfo
from meshserve.v1 import common_pb2

if TYPE_CHECKING:
    from gateway.serving import RequestContext  # serving imports this module

log = logging.getLogger(__name__)


def usage_info(usage: Usage) -> UsageInfo:
    """OpenAI usage object."""
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


async def _no_events() -> AsyncIterator[ChoiceEvent]:
    """No event (a MultiRun that never started)."""
    return
    yield


class MultiRun:
    """Several GenerationRuns (one per prompt) seen as one: global choice index =
    prompt index × n + choice index. The first events are peeked before the HTTP
    response starts so that early upstream errors keep their HTTP status."""

    def __init__(self, runs: list[GenerationRun], n: int) -> None:
        self.runs = runs
        self.n = n
        self._budget: tuple[TenantBudgets, Reservation] | None = None
        self._held: deque[ChoiceEvent] = deque()  # what `peek` took from `_merged`
        self._iter: AsyncIterator[ChoiceEvent] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    async def reserve(self, ctx: RequestContext) -> None:
        """Takes what the runs may use from the tenant's budgets (APIError 429 when they
        cannot cover it: nothing is queued then); `close` gives back what they did not use."""
        if ctx.budgets is None or not ctx.budgets.enabled:
            return
        tokens = sum(len(r.spec.prompt_ids) + r.spec.n * r.spec.sampling.max_tokens for r in self.runs)
        reservation = await ctx.budgets.reserve(ctx.tenant, tokens, self.runs[0].spec.service_class)
        if reservation is not None:
            self._budget = (ctx.budgets, reservation)

    def start(self) -> None:
        """Starts every run. One run's events are its own generator's (no fan-in layer
        on a chat's token path)."""
        for run in self.runs:
            run.start()
        self._iter = self.runs[0].events() if len(self.runs) == 1 else self._merged()

    async def _merged(self) -> AsyncIterator[ChoiceEvent]:
        queue: asyncio.Queue[tuple[int, ChoiceEvent | BaseException | None]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._drain(i, run, queue)) for i, run in enumerate(self.runs)]
        remaining = len(self.runs)
        while remaining or self._held:
            if self._held:
                yield self._held.popleft()
                continue
            offset, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                item.index += offset * self.n
                yield item

    @staticmethod
    async def _drain(
        offset: int, run: GenerationRun, queue: asyncio.Queue[tuple[int, ChoiceEvent | BaseException | None]]
    ) -> None:
        try:
            async for event in run.events():
                queue.put_nowait((offset, event))
        except APIError as exc:
            queue.put_nowait((offset, exc))
        except Exception as exc:
            log.exception("generation %s failed", run.spec.request_id)
            queue.put_nowait((offset, APIError(500, f"internal error: {type(exc).__name__}")))
        queue.put_nowait((offset, None))

    async def begin(self) -> None:
        """Puts every run's request on its worker's stream (raising APIError when one
        cannot be routed): what a streamed response builds next is built meanwhile."""
        if len(self.runs) == 1:
            await self.runs[0].begin()
        else:
            await asyncio.gather(*(run.begin() for run in self.runs))

    async def peek(self) -> None:
        """Waits for the first event with output (raising APIError on early failures);
        what it took, `events` yields first."""
        if self._iter is None:
            return
        async for event in self._iter:
            if len(self.runs) == 1:
                self.runs[0].hold(event)
            else:
                self._held.append(event)
            if event.token_ids or event.finish_reason or event.text:
                return

    def events(self) -> AsyncIterator[ChoiceEvent]:
        """The events, those `peek` took first: for one run, that run's own generator."""
        return self._iter if self._iter is not None else _no_events()

    def usage(self) -> Usage:
        """Usage summed over the prompts."""
        parts = [run.usage() for run in self.runs]
        return Usage(
            sum(u.prompt_tokens for u in parts),
            sum(u.completion_tokens for u in parts),
            sum(u.cached_tokens for u in parts),
        )

    def prompt_logprobs(self, index: int) -> tuple[list[int], list[common_pb2.TokenLogprob]]:
        """Prompt ids and prompt logprobs (entry i scores token i + 1) of the prompt of
        choice `index`, which asked for them (they come with the run's first output);
        a 500 when the worker did not send one per prompt token after the first."""
        run = self.runs[index // self.n]
        ids, logprobs = run.spec.prompt_ids, run.prompt_logprobs or []
        if len(logprobs) != len(ids) - 1:
            raise APIError(500, f"worker: {len(logprobs)} prompt logprobs for a {len(ids)}-token prompt")
        return ids, logprobs

    def completion_tokens_so_far(self) -> int:
        """Tokens generated so far over every prompt and choice."""
        return sum(run.completion_tokens_so_far() for run in self.runs)

    def close(self) -> None:
        """Cancels every run and settles the budget reservation (synchronous, idempotent)."""
        for task in self._tasks:
            task.cancel()
        for run in self.runs:
            run.close()
        if self._closed:
            return
        self._closed = True
        used = self.usage()
        spec = self.runs[0].spec
        admitted = [run.usage() for run in self.runs if run.admitted]
        tokens = sum(u.prompt_tokens + u.completion_tokens for u in admitted)
        metrics.TENANT_TOKENS.labels(spec.tenant, spec.service_class).inc(tokens)
        if self._budget is not None:
            budgets, reservation = self._budget
            self._budget = None
            budgets.settle_soon(reservation, used.prompt_tokens + used.completion_tokens)
