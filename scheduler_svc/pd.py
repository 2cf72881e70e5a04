"""Prefill/decode disaggregation: whether a route gets a prefill worker, and which.

The decoder is chosen first, as for any request (prefix + load). Then a prompt whose
tokens not cached on that decoder reach ``pd_min_prompt_tokens`` is handed off (the
``threshold`` decision: llm-d's P/D decider), by default unless the hand-off is expected
to give it its KV later than a prefill on the decoder would, by more than
``pd_handoff_margin`` times the prompt's own prefill there (the ``estimate`` decision:
Dynamo's disaggregated router weighs the prefill queue too; this weighs both sides'
queues and measured rates). A tie goes to the prefill worker: a
long prefill on the decoder stalls every stream it decodes, and leaves the prefill
worker's cores idle (docs/design-decisions.md, "P/D: hand off unless it is slower").
Each side's time is its queued prompt tokens (its last heartbeat, plus what this
scheduler routed there that the worker has not listed yet: `routed_prompt_tokens`, kept
by the route's lease) and the prompt, over its measured prefill rate; the hand-off adds
the pull at the decoder's measured import rate. Until no side has measured a rate yet,
the threshold alone decides. The estimate travels with the route
(`KvSource.expected_ms`): the decoder abandons a hand-off that runs well past it.

A prefill worker takes whole requests too (``pd_prefill_decodes``, on by default): for a
prompt too short to be handed off (or one whose KV cannot move) the routing policy ranks
it with the decoders, and one chosen prefills the prompt itself and decodes it
(``on_prefill_worker``). A P/D deployment so keeps every engine's capacity for what
disaggregation does not pay for, where keeping short prompts on the decoders alone left
the prefill worker idle and the decoders with twice the colocated load. A prompt long
enough for a hand-off is placed by this rule, which weighs the queued prompt tokens on
each side where the policy's request counts do not (`whole_on_prefill`): whole on a
prefill worker when one would compute it no later than the best decoder could itself (a
hand-off from it would add a pull and a decoder step to that very prefill), else on a
decoder, which the rule above then has prefill it or hand it off. The margin applies only
while prefill workers take hand-offs alone: when they carry streams too, a prefill on
either side stalls some, and the soonest side takes the prompt (docs/design-decisions.md,
"P/D: prefill workers also take whole requests"). A stream on an engine computing a long
prompt gets one token per chunk step, so while every prefill worker has a long prompt
queued, short prompts keep to the decoders (`short_on_decoders`), and a prefill worker
moves the short streams it holds to a decoder before a long prefill starts (the worker
ends them as moved; the gateway resumes them elsewhere with their output so far).

Only healthy prefill workers with room, the decoder's KV layout and a heartbeat within
``silent_after_s`` are candidates: a hung (SIGSTOPped) one stops getting hand-offs within
about a second, long before the registry's worker timeout. Requests with images, a LoRA
adapter or prompt logprobs stay on the decoder (their KV cannot come from elsewhere:
images and adapters live on the decoder; prompt logprobs are not reused).
Domain code: no grpc.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc import metrics
from scheduler_svc.registry import WorkerRegistry, WorkerState

__all__ = ["Handoff", "PdDecider"]

log = logging.getLogger(__name__)

# A prefill worker with at least 1/this of a hand-off's length queued takes no short
# prompts while a decoder has room (`PdDecider.short_on_decoders`).
LONG_QUEUE_SHARE = 4


@dataclass(frozen=True)
class Handoff:
    """A route's prefill worker and the expected seconds of the hand-off (0: no estimate)."""

    worker: WorkerState
    expected_s: float = 0.0


@dataclass(frozen=True)
class PdDecider:
    """The P/D rule above, with the scheduler's settings."""

    min_prompt_tokens: int
    margin: float = 0.5
    silent_after_s: float = 1.5
    estimate: bool = True  # False: the threshold decision

    def may_hand_off(self, prompt_tokens: int) -> bool:
        """Whether a text prompt of ``prompt_tokens`` is long enough for a hand-off (with
        nothing of it cached): it then runs on a decoder, not whole on a prefill worker."""
        return 0 < self.min_prompt_tokens <= prompt_tokens

    def whole_on_prefill(
        self,
        registry: WorkerRegistry,
        model: str,
        prompt_tokens: int,
        cached: Callable[[WorkerState], int],
        exclude: frozenset[str] = frozenset(),
    ) -> bool:
        """Whether a prompt of ``prompt_tokens`` that may be handed off runs whole on a
        prefill worker instead (``pd_prefill_decodes`` and the ``estimate`` decision): one
        with room computes it, behind its queue, no later than the decoder with room that
        would be soonest (`_margin`). ``cached``: a worker's cached prompt tokens.
        False until rates are measured, or with no decoder with room (the policy places it).
        Workers in ``exclude`` (those this request failed on) are not weighed."""
        if not self._weighs_whole(registry):
            return False
        prefill = self._live_prefill(registry, model, exclude)
        decoders = _decoders_with_room(registry, model, exclude)
        if not prefill or not decoders:
            return False
        measured = [
            w.load.prefill_tokens_per_s for w in prefill + decoders if w.load.prefill_tokens_per_s > 0
        ]
        if not measured:
            return False

        def rate(worker: WorkerState) -> float:  # its own, else another's (same model)
            return worker.load.prefill_tokens_per_s or measured[0]

        def seconds(worker: WorkerState) -> float:
            return _queue_s(worker, prompt_tokens - cached(worker), rate(worker)) or 0.0

        best = min(decoders, key=seconds)
        own_s = (prompt_tokens - cached(best)) / rate(best)
        return min(map(seconds, prefill)) <= seconds(best) + self._margin(registry) * own_s

    def short_on_decoders(
        self, registry: WorkerRegistry, model: str, exclude: frozenset[str] = frozenset()
    ) -> bool:
        """Whether a prompt too short for a hand-off keeps to the decoders
        (``pd_prefill_decodes`` and the ``estimate`` decision): every live prefill worker
        has a long prompt's tokens queued (a quarter of a hand-off's length), so a stream
        placed there would wait for its prefill steps (and be moved off before them), and
        a decoder has room (workers in ``exclude`` left out)."""
        if not self._weighs_whole(registry):
            return False
        prefill = self._live_prefill(registry, model, exclude)
        long_queue = self.min_prompt_tokens // LONG_QUEUE_SHARE
        busy = all(w.load.queued_prompt_tokens + w.routed_prompt_tokens >= long_queue for w in prefill)
        return bool(prefill) and busy and bool(_decoders_with_room(registry, model, exclude))

    def decide(
        self,
        registry: WorkerRegistry,
        decoder: WorkerState,
        uncached: int,
        exclude: frozenset[str] = frozenset(),
    ) -> Handoff | None:
        """The hand-off for a prompt of which ``uncached`` tokens are not in ``decoder``'s
        cache, or None (the decoder prefills it); counts the decision. A prefill worker in
        ``exclude`` (this request failed on it: hung, gone) is no source."""
        model = decoder.spec.model
        if self.min_prompt_tokens <= 0 or not registry.serving(model, "prefill"):
            return None  # P/D off, or no prefill worker of the model at all
        if decoder.spec.role == "prefill":
            return self._local("on_prefill_worker")  # a whole request there (pd_prefill_decodes)
        if uncached < self.min_prompt_tokens:
            return self._local("short")
        layout = decoder.spec.kv_layout
        candidates = [
            w for w in self._live_prefill(registry, model, exclude) if layout and w.spec.kv_layout == layout
        ]
        if not candidates:
            return self._local("no_prefill_worker")
        worker = min(
            candidates,
            key=lambda w: (_queue_s(w, uncached, _rate(w, decoder)) or 0.0, w.load_fraction(), w.worker_id),
        )
        remote = _handoff_s(worker, decoder, uncached)
        rate = _rate(decoder, worker)
        local = _queue_s(decoder, uncached, rate)
        # The margin is a share of this prompt's own prefill, not of the queues: behind
        # long queues a share of them would let the prefill worker's grow that much longer.
        margin = self._margin(registry) * uncached / rate if rate > 0.0 else 0.0
        slower = remote is not None and local is not None and remote > local + margin
        log.debug(
            "P/D %d tokens: hand-off to %s %s s (queued %d + %d at %.0f tok/s), local on %s %s s"
            " (queued %d + %d at %.0f tok/s)",
            uncached,
            worker.worker_id,
            _fmt(remote),
            worker.load.queued_prompt_tokens,
            worker.routed_prompt_tokens,
            _rate(worker, decoder),
            decoder.worker_id,
            _fmt(local),
            decoder.load.queued_prompt_tokens,
            decoder.routed_prompt_tokens,
            rate,
        )
        if self.estimate and slower:
            return self._local("local_faster")
        metrics.PD_DECISIONS.labels(decision="disaggregated").inc()
        return Handoff(worker, remote or 0.0)

    def _weighs_whole(self, registry: WorkerRegistry) -> bool:
        """Whether the P/D rules place whole requests by queued tokens: prefill workers
        take them (``pd_prefill_decodes``), the ``estimate`` decision, P/D on."""
        return self.estimate and registry.prefill_decodes and self.min_prompt_tokens > 0

    def _live_prefill(
        self, registry: WorkerRegistry, model: str, exclude: frozenset[str] = frozenset()
    ) -> list[WorkerState]:
        """The prefill workers of ``model`` with room and a heartbeat within
        ``silent_after_s`` (a hung one drops out long before the registry's timeout), but
        those in ``exclude``."""
        now = registry.now()
        return [
            w
            for w in registry.candidates(model, "prefill", exclude)
            if w.has_capacity() and now - w.last_seen <= self.silent_after_s
        ]

    def _margin(self, registry: WorkerRegistry) -> float:
        """The margin, while prefill workers carry no streams of their own: with
        ``pd_prefill_decodes`` a prefill on either side stalls streams, and the soonest
        side takes the prompt."""
        return 0.0 if registry.prefill_decodes else self.margin

    @staticmethod
    def _local(reason: str) -> None:
        metrics.PD_DECISIONS.labels(decision=reason).inc()
        return None


def _decoders_with_room(
    registry: WorkerRegistry, model: str, exclude: frozenset[str] = frozenset()
) -> list[WorkerState]:
    """The routable decoders of ``model`` (not prefill workers taking whole requests) with room."""
    decoders = registry.candidates(model, "decoder", exclude)
    return [w for w in decoders if w.spec.role != "prefill" and w.has_capacity()]


def _fmt(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.2f}"


def _rate(worker: WorkerState, other: WorkerState) -> float:
    """``worker``'s measured prefill rate, else ``other``'s (same model; 0: none measured)."""
    return worker.load.prefill_tokens_per_s or other.load.prefill_tokens_per_s


def _queue_s(worker: WorkerState, uncached: int, rate: float) -> float | None:
    """Seconds until ``worker`` has computed its queued prompt tokens and ``uncached`` more."""
    if rate <= 0.0:
        return None
    return (worker.load.queued_prompt_tokens + worker.routed_prompt_tokens + uncached) / rate


def _handoff_s(prefill: WorkerState, decoder: WorkerState, uncached: int) -> float | None:
    """The hand-off's expected seconds: the prefill worker's queue and prefill, then the pull."""
    prefill_s = _queue_s(prefill, uncached, _rate(prefill, decoder))
    if prefill_s is None:
        return None
    import_rate = decoder.load.kv_import_tokens_per_s
    return prefill_s + (uncached / import_rate if import_rate > 0.0 else 0.0)
