"""The worker's engine settings: each EngineConfig field is a worker flag and MESHSERVE_*
variable of its own name, and what they set is the engine configuration the worker runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.config import env_for, from_options, load_config
from worker_svc.config import WorkerConfig
from worker_svc.engine.config import EngineConfig

# A value other than the default for every engine option, as a flag would spell it.
ENGINE_FLAGS = {
    "block_size": ("8", 8),
    "num_kv_blocks": ("40", 40),
    "kv_cache_memory_mb": ("8", 8),
    "max_num_seqs": ("7", 7),
    "max_num_batched_tokens": ("96", 96),
    "max_model_len": ("128", 128),
    "enable_prefix_caching": ("false", False),
    "kv_tier_mb": ("64", 64),
    "kv_tier_path": ("/tmp/tier", "/tmp/tier"),
    "kv_tier_admit_after": ("3", 3),
    "dtype": ("bfloat16", "bfloat16"),
    "device": ("cuda:1", "cuda:1"),
    "attention_backend": ("sdpa", "sdpa"),
    "compile_model": ("false", False),
    "cpu_affinity": ("0", "0"),
    "engine_priority": ("normal", "normal"),
    "priority_step_ratio": ("3", 3.0),
    "generation_config": ("vllm", "vllm"),
    "cuda_graphs": ("false", False),
    "async_scheduling": ("off", "off"),
    "merge_projections": ("on", "on"),
    "kv_transfer_ttl_s": ("5", 5.0),
    "max_loras": ("0", 0),
    "max_lora_rank": ("8", 8),
    "max_cpu_loras": ("2", 2),
    "lora_modules": ("", ()),
}


def test_every_engine_field_is_a_worker_flag_that_reaches_the_engine(tiny_model_dir: Path) -> None:
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model_dir"}
    assert names == set(ENGINE_FLAGS), "a new engine field needs a case here"
    argv = ["--model-dir", str(tiny_model_dir)]
    for name, (text, _) in ENGINE_FLAGS.items():
        argv += ["--" + name.replace("_", "-"), text]
    engine = load_config(WorkerConfig, argv).engine
    assert engine.model_dir == str(tiny_model_dir)
    for name, (_, value) in ENGINE_FLAGS.items():
        default = getattr(EngineConfig(model_dir="/x"), name)
        if value != default:  # a case equal to the default would prove nothing
            assert getattr(engine, name) == value, name


def test_engine_env_round_trips(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = from_options(WorkerConfig, model_dir=str(tiny_model_dir), max_num_seqs=5, kv_cache_memory_mb=9)
    env = env_for(config)
    assert env["MESHSERVE_MAX_NUM_SEQS"] == "5" and env["MESHSERVE_KV_CACHE_MEMORY_MB"] == "9"
    assert "MESHSERVE_ENGINE" not in env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load_config(WorkerConfig, []) == config


def test_the_engine_priority_reaches_the_engine_and_is_validated(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHSERVE_ENGINE_PRIORITY", "normal")
    assert load_config(WorkerConfig, ["--model-dir", str(tiny_model_dir)]).engine.engine_priority == "normal"
    monkeypatch.delenv("MESHSERVE_ENGINE_PRIORITY")
    assert load_config(WorkerConfig, ["--model-dir", str(tiny_model_dir)]).engine.engine_priority == "auto"
    with pytest.raises(ValueError, match="engine_priority"):
        from_options(WorkerConfig, model_dir=str(tiny_model_dir), engine_priority="low")
    with pytest.raises(SystemExit):
        load_config(WorkerConfig, ["--model-dir", str(tiny_model_dir), "--engine-priority", "low"])


def test_unknown_options_and_a_missing_model_are_refused() -> None:
    with pytest.raises(TypeError, match="thread_priority"):
        from_options(WorkerConfig, model_dir="/x", thread_priority="idle")
    with pytest.raises(SystemExit):
        load_config(WorkerConfig, [])
