"""Garbage-collector settings of a long-running service process.

Why: every message through a service allocates short-lived objects (protobufs, dicts,
coroutines), and CPython's generational collector then walks the whole heap on each
full collection -- the loaded model, the tokenizer, the imported modules, the prefix
index, a large share of a busy service's time (docs/design-decisions.md, "Garbage
collector frozen after start-up"). Once start-up is over, the objects alive
then (modules, model, tokenizer) live as long as the process: `gc.freeze()` moves them
out of the collector's reach, and a larger first-generation threshold makes young
collections rarer without letting garbage cycles pile up (each still runs after
`GEN0_THRESHOLD` net allocations). vLLM and SGLang do the same after start-up.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

# Net allocations between young collections (CPython's default is 700).
GEN0_THRESHOLD = 20_000

_settled = False


def settle_heap() -> None:
    """Call once start-up is over (model loaded, servers listening): collects, freezes
    what survives, raises the young-generation threshold. Later calls do nothing."""
    global _settled
    if _settled:
        return
    _settled = True
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    log.debug("gc: %d objects frozen, gen0 threshold %d", gc.get_freeze_count(), GEN0_THRESHOLD)
