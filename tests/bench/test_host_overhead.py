"""The host-overhead bench drives the real engine loop with the forward stubbed out: every
row decodes each timed step, and nothing is left behind between concurrencies."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.host_overhead import NO_PENALTIES, decode_steps, stub_forward
from worker_svc.engine import EngineConfig, LLMEngine


def test_timed_steps_decode_every_row_and_leave_the_engine_empty(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model_dir=str(tiny_model_dir), dtype="float32", compile_model=False, num_kv_blocks=256)
    )
    stub_forward(engine)
    free = engine.block_manager.num_free_blocks()
    generated = engine.num_generated_tokens
    args = argparse.Namespace(steps=5, prompt_tokens=20, **NO_PENALTIES)
    times = decode_steps(engine, 3, args, seed=0)
    assert len(times) == 5 and all(t > 0 for t in times)
    # One token per row at the prefill's end, one more before timing, then one per timed step.
    assert engine.num_generated_tokens - generated == 3 * (1 + 1 + 5)
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks() == free
