"""The model's generation_config.json supplies the sampling fields a request leaves unset, as vLLM's
`--generation-config auto` does; `vllm` ignores it (EngineConfig.generation_config)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import GenerationConfig

from meshserve.v1 import common_pb2
from worker_svc import convert
from worker_svc.engine import EngineConfig, LLMEngine
from worker_svc.engine.model_runner import sampling_defaults


def test_only_the_fields_the_model_sets_are_defaults() -> None:
    config = GenerationConfig(temperature=0.3, top_p=0.8, repetition_penalty=1.1, max_new_tokens=5)
    assert sampling_defaults(config) == (("temperature", 0.3), ("top_p", 0.8), ("repetition_penalty", 1.1))
    assert sampling_defaults(GenerationConfig(eos_token_id=2)) == ()
    assert sampling_defaults(None) == ()


def test_an_out_of_range_default_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"generation_config\.json: top_p"):
        sampling_defaults(GenerationConfig(top_p=1.5))


def test_unset_request_fields_take_the_defaults_and_set_ones_win() -> None:
    defaults = (("temperature", 0.3), ("top_p", 0.8))
    unset = convert.sampling_params(common_pb2.SamplingParams(max_tokens=4), 10, 100, defaults=defaults)
    assert (unset.temperature, unset.top_p) == (0.3, 0.8)
    chosen = common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    params = convert.sampling_params(chosen, 10, 100, defaults=defaults)
    assert (params.temperature, params.top_p) == (0.0, 0.8)
    assert convert.sampling_params(common_pb2.SamplingParams(max_tokens=4), 10, 100).temperature == 1.0


@pytest.mark.parametrize("mode, expected", [("auto", (("temperature", 0.3), ("top_k", 20))), ("vllm", ())])
def test_the_engine_reads_the_models_file_unless_told_not_to(
    engine_model_dir: str, tmp_path: Path, mode: str, expected: tuple[tuple[str, float], ...]
) -> None:
    model = tmp_path / "model"
    shutil.copytree(engine_model_dir, model)
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.3, "top_k": 20}))
    engine = LLMEngine(
        EngineConfig(model_dir=str(model), num_kv_blocks=8, generation_config=mode, compile_model=False)
    )
    assert engine.model_info.sampling_defaults == expected


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="generation_config must be one of"):
        EngineConfig(model_dir="m", generation_config="hf")
