"""Decoders share KV: the decoder chosen for a request pulls the prompt's prefix from the
decoder that holds it instead of computing it.

The decoder is chosen as for any request (prefix + load). When another healthy decoder of
the same KV layout holds (in its cache or its KV tier: the prefix index counts both) at
least ``min_tokens`` more of the prompt's leading blocks, the route names it as the
request's KV source for those blocks (`KvSource.num_prompt_tokens`): the chosen decoder
asks it to publish them -- it computes one token past them and holds the blocks -- pulls
them over KvTransfer, verified as a P/D hand-off is, and computes the rest itself. Not when
the decoder's measured pull rate makes the pull slower than computing them (its measured
prefill rate), and never for requests whose KV cannot come from elsewhere (images, a LoRA
adapter, prompt logprobs). A failed or late pull costs the request a local prefill only
(the decoder's fallback, as for P/D). Domain code: no grpc.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc import metrics
from scheduler_svc.prefix_index import PrefixIndex
from scheduler_svc.registry import WorkerRegistry, WorkerState

__all__ = ["KvShare", "ShareDecider"]


@dataclass(frozen=True)
class KvShare:
    """The decoder holding the prefix, the prompt tokens it publishes, and the expected
    seconds of computing the shared blocks instead (the pull's deadline derives from it)."""

    worker: WorkerState
    num_tokens: int
    expected_s: float = 0.0


@dataclass(frozen=True)
class ShareDecider:
    """The rule above, with the scheduler's settings (``min_tokens`` 0: off)."""

    min_tokens: int
    silent_after_s: float = 1.5

    def decide(
        self,
        registry: WorkerRegistry,
        index: PrefixIndex,
        decoder: WorkerState,
        hashes: Sequence[int],
        matched_here: int,
        prompt_tokens: int,
        exclude: frozenset[str] = frozenset(),
    ) -> KvShare | None:
        """The share for a prompt of block ``hashes`` of which ``decoder`` holds the first
        ``matched_here``, or None (the decoder computes what it lacks). A decoder in
        ``exclude`` (this request failed on it) holds nothing to share."""
        layout = decoder.spec.kv_layout
        block_size = decoder.spec.block_size
        if self.min_tokens <= 0 or not layout or block_size <= 0:
            return None
        now = registry.now()
        others = [
            w
            for w in registry.candidates(decoder.spec.model, "decoder", exclude)
            if w is not decoder and w.spec.kv_layout == layout and now - w.last_seen <= self.silent_after_s
        ]
        if not others:
            return None
        usable = (prompt_tokens - 1) // block_size  # the last token is always computed
        matched = index.match(list(hashes[:usable]), [w.worker_id for w in others])
        holder = max(others, key=lambda w: (matched.get(w.worker_id, 0), -w.load_fraction()))
        blocks = min(matched.get(holder.worker_id, 0), usable)
        gained = (blocks - matched_here) * block_size
        if gained < self.min_tokens:
            return None
        import_rate = decoder.load.kv_import_tokens_per_s
        prefill_rate = decoder.load.prefill_tokens_per_s or holder.load.prefill_tokens_per_s
        local_s = gained / prefill_rate if prefill_rate > 0.0 else 0.0
        if import_rate > 0.0 and local_s and gained / import_rate > local_s:
            metrics.KV_SHARES.labels(decision="pull_slower").inc()
            return None
        metrics.KV_SHARES.labels(decision="shared").inc()
        # Without measured rates, a second: a holder slower than that is given up on soon.
        return KvShare(holder, blocks * block_size + 1, max(local_s, 1.0))
