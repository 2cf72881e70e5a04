"""deploy/served.py reads a decoder's engine back from its log, as the engine states it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.served_vs_vllm import METRICS, median_table
from deploy.served import config_differences, engine_config, ratios
from worker_svc.engine import LLMEngine, native
from worker_svc.engine.config import EngineConfig


def logged(message: str) -> str:
    """`message` in the services' log format (services/log.py), as `docker logs` shows it."""
    return f"2026-11-29 03:00:00,000 INFO [worker:decoder] worker_svc.engine.async_engine: {message}"


def test_the_start_up_line_reads_back_as_the_engine_that_wrote_it(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), num_kv_blocks=8, compile_model=False))
    log = "\n".join(["starting", logged("loading the model"), logged(f"engine: {engine.describe()}"), "done"])
    assert engine_config(log) == {
        "dtype": engine.model_info.dtype,
        "attention": engine.model_info.attention_backend,
        "compiled": "no",
        "native CPU kernels": "yes" if native.library() is not None else "no",
    }


def test_the_last_start_up_line_counts_and_a_log_without_one_is_an_error() -> None:
    old = (
        "engine: dtype float32, attention torch, compiled no (compile_model off), native CPU kernels no (x),"
    )
    new = "engine: dtype bfloat16, attention cpu, compiled yes (80.1 s), native CPU kernels yes, CUDA graphs off"
    assert engine_config("\n".join([logged(old), logged(new)]))["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="no engine start-up line"):
        engine_config(logged("engine: warming up") + "\nengine: dtype bfloat16 (not a service's line)")
    with pytest.raises(ValueError, match="native CPU kernels"):
        engine_config(logged("engine: dtype bfloat16, attention cpu, compiled yes (1 s)"))


def test_an_engine_unlike_make_serves_is_named_field_by_field() -> None:
    served = {"dtype": "bfloat16", "attention": "cpu", "compiled": "yes", "native CPU kernels": "yes"}
    eager = {**served, "attention": "torch", "compiled": "no", "native CPU kernels": "no"}
    assert config_differences(dict(served), served) == []
    assert config_differences(eager, served) == [
        "attention: deployed torch, make serve cpu",
        "compiled: deployed no, make serve yes",
        "native CPU kernels: deployed no, make serve yes",
    ]


def test_the_ratio_is_of_the_medians_over_alternating_rounds() -> None:
    runs = [
        {"side": side, "concurrency": c, "round": r, **dict.fromkeys(METRICS, tok_s)}
        for side, c, r, tok_s in [
            ("make_serve", 8, 1, 100.0), ("make_serve", 8, 2, 300.0), ("make_serve", 8, 3, 110.0),
            ("deployed", 8, 1, 95.0), ("deployed", 8, 2, 10.0), ("deployed", 8, 3, 99.0),
            ("make_serve", 32, 1, 200.0), ("deployed", 32, 1, 150.0),
        ]
    ]  # fmt: skip
    medians = median_table(runs, "side", ["make_serve", "deployed"], [8, 32])
    # One bad round on either side moves neither median: 95/110 and 150/200.
    assert ratios(medians) == {"c=8": 0.864, "c=32": 0.75}
