"""EngineConfig / SamplingParams validation: ValueError names the field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from worker_svc.engine import EngineConfig, SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 0),
        ("block_size", True),
        ("num_kv_blocks", -1),
        ("max_num_seqs", -1),
        ("max_num_batched_tokens", 0),
        ("max_model_len", -1),
        ("kv_cache_memory_mb", 0),
        ("dtype", "float64"),
        ("device", "tpu"),
        ("attention_backend", "flash"),
        ("enable_prefix_caching", "yes"),
    ],
)
def test_engine_config_rejects(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model_dir="/x", **{field: value})


def test_engine_config_defaults() -> None:
    cfg = EngineConfig(model_dir="/x")
    assert cfg.block_size == 16 and cfg.num_kv_blocks == 0 and cfg.max_num_batched_tokens == 512
    assert cfg.compiles, "the fast path is the default on CPU"
    assert EngineConfig(model_dir="/x", device="cuda").compiles  # and on CUDA, inside the graphs
    assert EngineConfig(model_dir="/x", compile_model=False).compile_skipped() == "compile_model off"
    with pytest.raises(ValueError, match="model_dir"):
        EngineConfig(model_dir="")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.1),
        ("seed", -1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", math.nan),
        ("max_tokens", -1),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("stop_token_ids", (-3,)),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("ignore_eos", 1),
    ],
)
def test_sampling_params_reject(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_sampling_params_min_tokens_above_max() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3).validate()


def test_sampling_params_valid() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0, top_k=0, top_p=0.5, min_p=0.1, seed=2**63, logprobs=0).validate()
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
