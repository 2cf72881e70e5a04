"""Tests for devtools.build_model: a --tiny build must be a loadable, chat-ready HF model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from devtools import build_model


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("build") / "tiny-llama"
    assert build_model.main(["--out", str(out), "--tiny"]) == 0
    return out


@pytest.fixture(scope="module")
def tokenizer(built_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(built_dir)


@pytest.fixture(scope="module")
def model(built_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(built_dir)


def test_writes_standard_hf_directory(built_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (built_dir / name).is_file(), name
    tokenizer_config = json.loads((built_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert not built_dir.with_name(built_dir.name + ".tmp").exists()


def test_tiny_config(model: Any, tokenizer: Any) -> None:
    config = model.config
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.intermediate_size == 128
    assert config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings is False
    assert model.dtype == torch.float32


def test_special_tokens(model: Any, tokenizer: Any) -> None:
    ids = {
        tok: tokenizer.convert_tokens_to_ids(tok) for tok in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    }
    assert ids["<|endoftext|>"] == 0
    assert tokenizer.bos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert set(model.generation_config.eos_token_id) == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == ids["<|im_start|>"]


@pytest.mark.parametrize(
    "text", ["héllo wörld ✓ 你好", "emoji 🎉🚀 and  spaces\n\ttabs", "plain English text."]
)
def test_utf8_round_trip(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_chat_template_generation_prompt(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello, who are you?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHello, who are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert without == "<|im_start|>user\nHello, who are you?<|im_end|>\n"


def test_chat_template_tools_and_parts(tokenizer: Any) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather here?"}, {"type": "image_url"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "sunny"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert json.dumps(tools[0]) in prompt
    assert "<tool_call>" in prompt.split("<|im_start|>user")[0]
    assert "<|im_start|>user\nWeather here?<image><|im_end|>\n" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_greedy_generate(model: Any, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_len = inputs["input_ids"].shape[1]
    first = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    second = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert prompt_len < first.shape[1] <= prompt_len + 8
    assert torch.equal(first, second)
    # Greedy means: each new token is the argmax of the model's logits at its position
    # (generate stops early only on an EOS token).
    new = first[0, prompt_len:].tolist()
    with torch.no_grad():
        logits = model(input_ids=first[:, :-1]).logits[0, prompt_len - 1 :]
    assert logits.argmax(dim=-1).tolist() == new
    eos = set(model.generation_config.eos_token_id)
    assert len(new) == 8 or new[-1] in eos
    # The completion decodes to real text that follows the rendered prompt exactly.
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert text.strip(), new
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(first[0]) == rendered + tokenizer.decode(new)


def test_failed_write_keeps_previous_build(
    built_dir: Path, model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = (built_dir / "config.json").read_bytes()

    def broken_save(model: Any, tokenizer: Any, directory: Path, info: dict[str, object]) -> None:
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(build_model, "save_model", broken_save)
    with pytest.raises(OSError, match="disk full"):
        build_model.write_atomically(model, tokenizer, built_dir, {})
    assert (built_dir / "config.json").read_bytes() == before
    assert not built_dir.with_name(built_dir.name + ".tmp").exists()


def test_rewrite_replaces_directory(tmp_path: Path, model: Any, tokenizer: Any) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old build")
    build_model.write_atomically(model, tokenizer, out, {"seed": 0})
    assert (out / "config.json").is_file()
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_cli_defaults() -> None:
    full = build_model.parse_args(["--out", "x"])
    assert (full.seed, full.vocab_size) == (0, 4096)
    assert full.shape == build_model.ModelShape(256, 688, 4, 8, 4)
    tiny = build_model.parse_args(["--out", "x", "--tiny", "--seed", "3"])
    assert (tiny.seed, tiny.shape) == (3, build_model.TINY_SHAPE)
