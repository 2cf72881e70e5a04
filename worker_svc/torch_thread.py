"""The one long-lived thread a worker role's torch work runs on: its model's build and
every forward (the encoder and embedding roles; the decoder's engine has its own thread,
`AsyncLLMEngine`).

Why one: libgomp keeps an OpenMP thread pool for every thread that ran a parallel region,
for as long as that thread lives. With pools on two live threads (a model built on one
executor thread and run on another, or forwards spread over a pool of threads) libgomp
manages more threads than there are CPUs and cuts every barrier's spin to ~100
iterations: the forwards sleep in a futex and are woken at almost every op, which slows
the decoder's engine (docs/design-decisions.md, "Torch work on one long-lived thread per
process"). One thread also keeps two
requests' forwards from splitting the cores between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class TorchThread:
    """Runs functions one at a time on a single named thread, awaited from the event loop."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on the thread, after what was submitted before it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def shutdown(self) -> None:
        """Stops the thread once its current call returns; calls still waiting are dropped."""
        self._executor.shutdown(wait=False, cancel_futures=True)
