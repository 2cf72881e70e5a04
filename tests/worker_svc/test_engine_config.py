"""The worker's settings reach its engine (a field dropped here is silently ignored)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from worker_svc.config import WorkerConfig
from worker_svc.main import engine_config


def test_every_engine_setting_of_the_worker_reaches_the_engine(tiny_model_dir: Path) -> None:
    config = WorkerConfig(
        model_dir=str(tiny_model_dir),
        block_size=8,
        max_num_seqs=7,
        max_num_batched_tokens=96,
        dtype="bfloat16",
        compile_model=True,
        cuda_graphs=False,  # not the default: the field must reach the engine
        cpu_affinity="0",
        enable_prefix_caching=False,
    )
    engine = engine_config(config)
    shared = {f.name for f in dataclasses.fields(engine)} & {f.name for f in dataclasses.fields(config)}
    for name in shared - {"num_kv_blocks", "max_model_len"}:  # 0 in the worker means None
        assert getattr(engine, name) == getattr(config, name), name
    assert {"compile_model", "cuda_graphs", "cpu_affinity", "dtype", "block_size"} <= shared


def test_the_engine_priority_reaches_the_engine_and_is_validated(tiny_model_dir: Path) -> None:
    config = WorkerConfig(model_dir=str(tiny_model_dir), engine_priority="normal")
    assert engine_config(config).thread_priority == "normal"
    assert engine_config(WorkerConfig(model_dir=str(tiny_model_dir))).thread_priority == "auto"
    with pytest.raises(ValueError, match="engine_priority"):
        WorkerConfig(model_dir=str(tiny_model_dir), engine_priority="low")
