"""Token-budget scheduler: one loop per step, prefill and decode mixed (vLLM v1 style).

Each step has a budget of ``max_num_batched_tokens``. Running requests are served
first, in admission order, their decodes before their chunks: a decode needs 1 token, a
request in chunked prefill needs the rest of its prompt (capped by the remaining budget;
decodes first, so that a long prompt's chunks never stall the streams admitted after
it). Then waiting requests are
admitted by (priority desc, arrival) while budget, ``max_num_seqs`` and free blocks
allow.

Whole prompts when they fit: a waiting request whose uncached prompt does not fit the
remaining budget but would fit a step holding only the running requests' decodes
(``num_new <= max_num_batched_tokens - len(running)``) waits for a later step instead of
being split. Only prompts too long for that are chunked (to the remaining budget). A
split prompt is prefilled as several smaller matmuls plus attention over its cached
part, which rounds differently from one forward over the whole prompt (bf16 greedy
tokens then leave transformers' ``generate``); a whole prompt costs at most one step of
delay and no throughput (the step it waits for is taken anyway). Every scheduled request
simply advances ``num_computed_tokens`` towards ``num_tokens`` -- there is no separate
prefill/decode phase.

When a running request cannot get a block, the lowest-priority, latest-arrived
running request is preempted (blocks freed, status PREEMPTED, back to the waiting
queue; its tokens are recomputed later, mostly from the prefix cache). A step that
preempted admits no new requests, to avoid thrashing.

Priority displaces: a waiting request that is next in line but blocked by
``max_num_seqs`` or by free blocks preempts the lowest-priority, latest-arrived running
request of strictly lower priority (on blocks, only when the free blocks and those the
lower-priority requests hold could make room). A preempted request keeps its arrival
number, so it resumes ahead of its own class's later arrivals; one preempted
``MAX_DISPLACEMENTS`` times is not displaced again, so nothing thrashes. (vLLM's
priority policy preempts only under KV pressure, never for ``max_num_seqs``.)

A prompt of higher priority is prefilled in a step of its own class: while a request
whose priority is above some running request's has a prompt to prefill (running, or next
in line and able to start now), running requests of lower priority sit the step out. Its
first token then costs a prefill of its own, not a prefill plus a whole batch of decodes
of the classes it outranks; they lose one step per such prompt (docs/design-decisions.md,
"Priority displaces running requests"). Equal priorities never trigger it.

The lower priorities' share of a step is capped while requests of more than one priority
run (``lower_share``: the engine's measured step cost): the highest running priority's
rows are scheduled first, then lower-priority rows -- those that sat out longest first,
their prompts chunked to fit -- up to the tokens that keep the step within a multiple of
what the highest priority's rows alone would take. A flood of lower priority then costs
an interactive request a short step, not a full batch, at each of its tokens and before
its first (docs/design-decisions.md, "Lower priorities' share of a step"). The cap holds
for ``PRIORITY_HOLD_STEPS`` steps after the last higher-priority row ran, as if one of its
rows were in the step: the next request of that class, arriving between two, then waits
for a short step to end, not a whole batch.

Short prompts do not wait behind a long one's chunks: a prompt in chunked prefill
leaves room in each step for the waiting requests next in line (of its priority or
above) whose uncached prompts fit whole in ``1 / SHORT_PROMPT_SHARE`` of the step budget
together -- a chat, or a handed-off prompt whose KV was imported and needs a few tokens.
They start in the same step rather than after the long prompt's last chunk; the long
prompt's prefill takes at most that share longer (vLLM's ``long_prefill_token_threshold``
serves the same end; docs/design-decisions.md, "Short prompts beside a long prefill").

LoRA: the running requests use at most ``max_loras`` adapters (the model runner's
resident slots). A waiting request whose adapter would be one too many is skipped, not
blocked on: requests behind it (base model, or an adapter already running) go first.
So that the skipped one is not starved by a steady stream of those, the running adapter
with the fewest running requests admits no new request while one waits for a slot: it
drains, its slot frees, and the waiting adapter takes it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from worker_svc.engine.block_manager import BlockManager
from worker_svc.engine.request import Request, RequestStatus
from worker_svc.engine.step_cost import Share

__all__ = ["MAX_DISPLACEMENTS", "ScheduledRequest", "SchedulerOutput", "StepScheduler"]

# Preemptions after which a running request is no longer displaced by higher priority.
MAX_DISPLACEMENTS = 2
# Short prompts next in line may take up to 1/this of a step beside a chunked prefill.
SHORT_PROMPT_SHARE = 4
# Steps the lower priorities' share stays capped after the last higher-priority row ran.
PRIORITY_HOLD_STEPS = 16


@dataclass
class ScheduledRequest:
    """``num_new_tokens`` tokens of ``request`` starting at position ``start`` run this step."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def end(self) -> int:
        """Position after the last token computed this step."""
        return self.start + self.num_new_tokens

    @property
    def needs_sample(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits are sampled."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What one engine step computes."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Total tokens in the step's batch."""
        return sum(s.num_new_tokens for s in self.scheduled)


def _waiting_key(request: Request) -> tuple[int, int]:
    return (-request.priority, request.arrival_seq)


def _in_prefill(request: Request) -> bool:
    """Whether ``request`` computes more than one token next: a chunk, not a decode."""
    return request.num_tokens - request.num_computed_tokens > 1


def _last_in_flight(request: Request) -> bool:
    """Whether the tokens ``request`` has in flight take it to its ``max_tokens``: it
    gets no row ahead of reading them back (validation keeps prompt plus ``max_tokens``
    within the model's length, so that bound is the only one to check)."""
    return request.num_output_tokens + request.in_flight >= request.sampling_params.max_tokens


class StepScheduler:
    """Decides, each step, which requests compute how many tokens."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int = 0,
        lower_share: Callable[[int, int], Share | None] | None = None,
    ) -> None:
        self.block_manager = block_manager
        # What lower priorities may add to a step whose highest running priority computes
        # the given rows and tokens (None: no cap; module docstring).
        self.lower_share = lower_share
        self.num_steps = 0
        self._top_seen = (0, -PRIORITY_HOLD_STEPS)  # (priority, step) of the last capping row
        # At most this many LoRA adapters among the running requests (the resident slots).
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by _waiting_key
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # preemptions by a waiting request of higher priority

    @property
    def short_prompt_tokens(self) -> int:
        """The most tokens of a short prompt: ``1 / SHORT_PROMPT_SHARE`` of a step (module
        docstring)."""
        return self.max_num_batched_tokens // SHORT_PROMPT_SHARE

    def add(self, request: Request) -> None:
        """Queue a new (or preempted) request."""
        bisect.insort(self.waiting, request, key=_waiting_key)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Drop a request (finished or aborted) and free its blocks."""
        self.detach(request)
        self.block_manager.free(request)

    def detach(self, request: Request) -> None:
        """Drop a request but leave its blocks to the caller (a finished prefill-only
        request's KV stays pinned for its transfer)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> SchedulerOutput:
        """Build this step's batch."""
        floor = self._priority_floor()
        out = self._build(floor)
        if floor is not None and not out.scheduled and not out.preempted:
            out = self._build(None)  # the prompt could not start after all: no empty step
        self.num_steps += 1
        for item in out.scheduled:
            item.request.last_step = self.num_steps
        top = self._capped_below()
        if top is not None and any(item.request.priority >= top for item in out.scheduled):
            self._top_seen = (top, self.num_steps)
        return out

    def _build(self, floor: int | None) -> SchedulerOutput:
        out = SchedulerOutput()
        top = self._capped_below() if floor is None else None
        share = None
        short = self._short_waiting(floor)
        if top is None:
            budget = self._schedule_running(
                out, list(self.running), self.max_num_batched_tokens, floor, short
            )
        else:
            budget, share = self._schedule_capped(out, top, short)
        if not out.preempted:
            self._schedule_waiting(out, budget, floor, top, share)
        return out

    def _schedule_capped(
        self, out: SchedulerOutput, top: int, short: list[tuple[int, int]]
    ) -> tuple[int, Share | None]:
        """Running requests of priority ``top`` first, then those below it within their
        share, those that sat out longest first (module docstring); the budget left and
        the share left (None: no step cost known yet, no cap)."""
        protected = [r for r in self.running if r.priority >= top]
        budget = self._schedule_running(out, protected, self.max_num_batched_tokens, None, short)
        assert self.lower_share is not None  # _capped_below checked it
        # None of ``top`` running (the hold): the step one of its requests would share.
        rows = max(len(out.scheduled), 1)
        share = self.lower_share(rows, max(self.max_num_batched_tokens - budget, rows))
        lower = sorted((r for r in self.running if r.priority < top), key=lambda r: r.last_step)
        return self._schedule_running(out, lower, budget, None, short, share), share

    def _short_waiting(self, floor: int | None) -> list[tuple[int, int]]:
        """(priority, uncached prompt tokens) of the waiting requests next in line whose
        prompts fit whole in the short prompts' share of a step together (module
        docstring): a chunked prefill leaves them room."""
        limit = self.short_prompt_tokens
        slots = self.max_num_seqs - len(self.running)
        short: list[tuple[int, int]] = []
        total = 0
        for request in self.waiting[: max(slots, 0)]:
            if floor is not None and request.priority < floor:
                break
            needed = max(request.num_tokens - self.block_manager.num_cached_prefix_tokens(request), 1)
            total += needed
            if total > limit:
                break
            short.append((request.priority, needed))
        return short

    def _capped_below(self) -> int | None:
        """The highest running priority when some running request has a lower one and a
        share is set: requests below it take a capped share of the step (module
        docstring); None: no cap this step."""
        if self.lower_share is None or not self.running:
            return None
        top = max(r.priority for r in self.running)
        held, seen_at = self._top_seen
        if self.num_steps - seen_at < PRIORITY_HOLD_STEPS:
            top = max(top, held)
        return top if top > min(r.priority for r in self.running) else None

    def _priority_floor(self) -> int | None:
        """The priority below which requests sit this step out (module docstring): that of
        the highest-priority prompt to prefill now (running, or next in line and able to
        start), when some running request has a lower one; None: everyone runs."""
        if not self.running:
            return None
        top = max(
            (r.priority for r in self.running if r.num_computed_tokens < r.num_prompt_tokens), default=None
        )
        if (
            self.waiting
            and (top is None or self.waiting[0].priority > top)
            and self._can_start(self.waiting[0])
        ):
            top = self.waiting[0].priority
        if top is None or top <= min(r.priority for r in self.running):
            return None
        return top

    def _can_start(self, request: Request) -> bool:
        """Whether waiting ``request`` could be admitted now (a sequence slot, free blocks
        or ones that displacing lower priorities frees, its adapter's slot)."""
        adapters = {r.lora_name for r in self.running if r.lora_name}
        draining = self._draining_adapter() if self.max_loras else ""
        if self._adapter_waits(request, adapters, draining):
            return False
        victims, held = self._victims(request)
        if len(self.running) >= self.max_num_seqs and not victims:
            return False
        num_new = min(request.num_tokens - request.num_computed_tokens, self.max_num_batched_tokens)
        return (
            self.block_manager.num_blocks_needed(request, num_new)
            <= self.block_manager.num_free_blocks() + held
        )

    def _schedule_running(
        self,
        out: SchedulerOutput,
        requests: list[Request],
        budget: int,
        floor: int | None,
        short: list[tuple[int, int]],
        share: Share | None = None,
    ) -> int:
        """Schedules running ``requests`` in order, decodes before chunks, within ``budget``
        (and ``share``, until a row no longer fits it), a chunk leaving room for the
        ``short`` waiting prompts of its priority or above; what is left of the budget."""
        # A snapshot (preemption removes requests from self.running); the sort is stable.
        for request in sorted(requests, key=_in_prefill):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            if floor is not None and request.priority < floor:
                continue
            if request.in_flight and _last_in_flight(request):
                continue  # its token in flight is its last (async scheduling)
            room = budget
            if _in_prefill(request):  # a chunk
                room -= sum(tokens for priority, tokens in short if priority >= request.priority)
            num_new = min(request.num_tokens - request.num_computed_tokens, room)
            if num_new <= 0:  # nothing to compute, or the step's room is the short prompts'
                continue
            if share is not None:
                num_new = share.take(num_new)
                if num_new == 0:
                    break
            while not self.block_manager.append_slots(request, num_new):
                victim = min(self.running, key=lambda r: (r.priority, -r.arrival_seq))
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
                budget -= num_new
        return budget

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt ``victim``; returns budget given back if it was already scheduled this step."""
        refund = 0
        for k, sched in enumerate(out.scheduled):
            if sched.request is victim:
                refund = sched.num_new_tokens
                del out.scheduled[k]
                break
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        self.add(victim)
        return refund

    def _displace(self, request: Request, out: SchedulerOutput, blocks: int) -> int | None:
        """Preempt the running request that waiting ``request`` displaces (module docstring);
        the budget it gives back, or None when none may be displaced. ``blocks``: the free
        blocks ``request`` needs (0: it waits for a sequence slot, not for blocks)."""
        victims, held = self._victims(request)
        if not victims:
            return None
        if blocks and self.block_manager.num_free_blocks() + held < blocks:
            return None
        self.num_priority_preemptions += 1
        return self._preempt(min(victims, key=lambda r: (r.priority, -r.arrival_seq)), out)

    def _victims(self, request: Request) -> tuple[list[Request], int]:
        """The running requests ``request`` may displace, and the blocks they hold (shared
        prefix blocks overcount: a bound)."""
        victims = [
            r for r in self.running if r.priority < request.priority and r.num_preemptions < MAX_DISPLACEMENTS
        ]
        return victims, sum(len(r.block_table) for r in victims)

    def _adapter_waits(self, request: Request, adapters: set[str], draining: str) -> bool:
        """Whether ``request``'s adapter has no slot now: its adapter drains, or would be one
        too many beside the running ``adapters`` (module docstring)."""
        return bool(request.lora_name) and (
            request.lora_name == draining
            or (request.lora_name not in adapters and len(adapters) >= self.max_loras)
        )

    def _draining_adapter(self) -> str:
        """The running adapter that admits nothing new because a waiting request needs its
        slot ("" when no request waits for a slot; module docstring)."""
        counts: dict[str, int] = {}
        for r in self.running:
            if r.lora_name:
                counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
        blocked = any(r.lora_name and r.lora_name not in counts for r in self.waiting)
        if len(counts) < self.max_loras or not blocked:
            return ""
        return min(counts, key=lambda name: (counts[name], name))

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, floor: int | None, top: int | None, share: Share | None
    ) -> None:
        """Admits waiting requests within ``budget``; those below priority ``top`` (a capped
        step) within ``share`` too, their prompts chunked to fit it."""
        bm = self.block_manager
        adapters = {r.lora_name for r in self.running if r.lora_name}
        draining = self._draining_adapter() if self.max_loras else ""
        i = 0
        while i < len(self.waiting) and budget > 0:
            request = self.waiting[i]
            if floor is not None and request.priority < floor:
                break  # sorted by priority: the rest are below the floor too
            if self._adapter_waits(request, adapters, draining):
                i += 1  # no slot for its adapter now: later requests may go first
                continue
            if len(self.running) >= self.max_num_seqs:
                refund = self._displace(request, out, 0)
                if refund is None:
                    break
                budget += refund
                continue
            capped = share is not None and top is not None and request.priority < top
            cached = bm.num_cached_prefix_tokens(request)
            needed = request.num_tokens - cached
            if not capped and budget < needed <= self.max_num_batched_tokens - len(self.running):
                break  # fits whole in a later step: not split (module docstring)
            num_new = min(needed, budget)
            if share is not None and capped:
                num_new = share.take(num_new)
                if num_new == 0:
                    break
            # Head-of-line blocking on purpose: skipping ahead would starve big/high-priority requests.
            if not bm.allocate(request, num_new):
                refund = self._displace(request, out, bm.num_blocks_needed(request, num_new))
                if refund is None:
                    break
                budget += refund
                continue
            self.waiting.pop(i)
            if request.lora_name:
                adapters.add(request.lora_name)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
