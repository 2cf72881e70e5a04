"""Prefill/decode disaggregation: whether a route gets a prefill worker, and which.

The decoder is chosen first, as for any request (prefix + load). Then, when the prompt
tokens that decoder does not have cached reach ``pd_min_prompt_tokens`` and a healthy
prefill worker with free capacity and the decoder's KV layout exists, the least loaded one
is paired with it (llm-d's P/D decider: a threshold on the uncached prompt). Requests
with images or prompt logprobs stay on the decoder (their KV cannot come from elsewhere,
or is not reused). Domain code: no grpc.
"""

from __future__ import annotations

from scheduler_svc import metrics
from scheduler_svc.registry import WorkerRegistry, WorkerState

__all__ = ["pick_prefill_worker"]


def pick_prefill_worker(
    registry: WorkerRegistry,
    decoder: WorkerState,
    uncached_tokens: int,
    min_prompt_tokens: int,
    exclude: frozenset[str] = frozenset(),
) -> WorkerState | None:
    """The prefill worker to pair with ``decoder`` for a prompt of which
    ``uncached_tokens`` are not in the decoder's cache, or None (decode prefills itself)."""
    model = decoder.spec.model
    if min_prompt_tokens <= 0 or not registry.serving(model, "prefill"):
        return None  # P/D off, or no prefill worker of the model at all
    if uncached_tokens < min_prompt_tokens:
        metrics.PD_DECISIONS.labels(decision="short").inc()
        return None
    layout = decoder.spec.kv_layout
    candidates = [
        w
        for w in registry.candidates(model, "prefill", exclude)
        if layout and w.spec.kv_layout == layout and w.has_capacity()
    ]
    if not candidates:
        metrics.PD_DECISIONS.labels(decision="no_prefill_worker").inc()
        return None
    metrics.PD_DECISIONS.labels(decision="disaggregated").inc()
    return min(candidates, key=lambda w: (w.load_fraction(), w.worker_id))
