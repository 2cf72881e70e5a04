"""An in-process engine in a child process of its own, its requests timed in that process.

Why a process per engine: libgomp keeps an OpenMP thread pool for every thread that ran a
parallel region, for the thread's life. Several engines in one process (several engine
threads) make it manage more threads than there are CPUs, and it then cuts every
barrier's spin short: each engine sleeps and is woken at almost every op and runs 20-27 %
slower than alone (bench/README "Session 17"). A benchmark that needs several in-process
engines at once (`mesh_overhead --ttft-instances`) runs each in an `EngineChild`.

The child runs a block of requests one at a time through its `AsyncLLMEngine` with the
same client code as an engine in the benchmark's own process (`run_generate_workload`)
and sends back the block's TTFT p50: no inter-process hop inside what is timed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from multiprocessing.connection import Connection

import torch

from bench.engine_bench import Workload, engine_generate_fn, run_generate_workload
from worker_svc.engine import AsyncLLMEngine, EngineConfig

_START_TIMEOUT_S = 300.0


class EngineChild:
    """One engine in a spawned process; `run_block` times a block of requests there."""

    def __init__(self, config: EngineConfig, threads: int = 0) -> None:
        """Starts the process and waits until its engine is built (`threads`: torch
        intra-op threads there, 0 for torch's default)."""
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end, config, threads), daemon=True)
        self._process.start()
        child_end.close()
        if not self._conn.poll(_START_TIMEOUT_S):
            self.close()
            raise TimeoutError(f"the engine child did not start within {_START_TIMEOUT_S:g} s")
        started = self._conn.recv()
        if started != "ready":
            self.close()
            raise RuntimeError(f"the engine child failed to start: {started}")

    async def run_block(self, workload: Workload, salt: str, id_prefix: str) -> float:
        """Runs `workload` at concurrency 1 in the child (cache salt `salt`); its TTFT p50 (ms)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._conn.send, (workload, salt, id_prefix))
        reply: float | str = await loop.run_in_executor(None, self._conn.recv)
        if isinstance(reply, str):
            raise RuntimeError(f"the engine child failed a block: {reply}")
        return reply

    def close(self) -> None:
        """Stops the child (its engine shut down first when it still answers)."""
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()


def _serve(conn: Connection, config: EngineConfig, threads: int) -> None:
    """The child: builds the engine, then runs blocks until it reads None."""
    if threads:
        torch.set_num_threads(threads)
    try:
        engine = AsyncLLMEngine(config)
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    asyncio.run(_run_blocks(conn, engine))


async def _run_blocks(conn: Connection, engine: AsyncLLMEngine) -> None:
    engine.start()
    conn.send("ready")
    try:
        # Blocking reads stall this loop only between blocks, when nothing else runs on it.
        while (job := conn.recv()) is not None:
            workload, salt, id_prefix = job
            try:
                row, _ = await run_generate_workload(
                    engine_generate_fn(engine, salt), workload, 1, "in_process", id_prefix
                )
            except Exception as exc:  # reported to the parent, which raises it
                conn.send(f"{type(exc).__name__}: {exc}")
                continue
            conn.send(row.ttft_ms["p50"])
    finally:
        await engine.shutdown()
