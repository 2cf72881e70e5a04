"""Renderer: chat templates, validation errors naming fields, sandbox, completion prompts."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from services.completion_prompt import completion_token_ids
from services.errors import InvalidArgument
from tokenizer_svc.renderer import Renderer

PngFactory = Callable[..., str]

USER = [{"role": "user", "content": "What is the weather?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def invalid(param: str, match: str | None = None) -> Any:
    """Expects an InvalidArgument whose message mentions `param` (and `match`)."""
    return pytest.raises(InvalidArgument, match=match or param.replace("[", r"\[").replace("]", r"\]"))


def test_chat_matches_transformers_and_tokenizes(renderer: Renderer) -> None:
    result = renderer.render_chat(USER)
    expected = renderer.tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert result.prompt_text == expected
    assert result.prompt_text.endswith("<|im_start|>assistant\n")
    assert result.prompt_token_ids == renderer.encode(expected, False)
    assert result.mm_items == []


def test_all_roles_parts_and_tool_calls(renderer: Renderer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Dev note."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = renderer.render_chat(messages, tools=TOOLS).prompt_text
    assert "<|im_start|>developer\nDev note.<|im_end|>" in text
    assert "line one\nline two" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_tools_rendered_unless_tool_choice_none(renderer: Renderer) -> None:
    assert '"name": "get_weather"' in renderer.render_chat(USER, tools=TOOLS).prompt_text
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert "# Tools" in renderer.render_chat(USER, tools=TOOLS, tool_choice=named).prompt_text
    assert "# Tools" not in renderer.render_chat(USER, tools=TOOLS, tool_choice="none").prompt_text


@pytest.mark.parametrize(
    ("tools", "tool_choice", "param"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (None, "required", "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        ([{"type": "function", "function": {}}], None, "tools[0].function.name"),
        ({"a": 1}, None, "tools"),
    ],
)
def test_bad_tools_and_tool_choice(renderer: Renderer, tools: Any, tool_choice: Any, param: str) -> None:
    with invalid(param):
        renderer.render_chat(USER, tools=tools, tool_choice=tool_choice)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ({"role": "user"}, "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], "messages[1].role"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_bad_messages_name_the_field(renderer: Renderer, messages: Any, param: str) -> None:
    with invalid(param) as info:
        renderer.render_chat(messages)
    assert info.value.param == param


def test_generation_prompt_flags(renderer: Renderer) -> None:
    with invalid("add_generation_prompt", match="add_generation_prompt and continue_final_message"):
        renderer.render_chat(USER, add_generation_prompt=True, continue_final_message=True)
    no_prompt = renderer.render_chat(USER, add_generation_prompt=False).prompt_text
    assert no_prompt.endswith("<|im_end|>\n")
    partial = [*USER, {"role": "assistant", "content": "The weather is"}]
    text = renderer.render_chat(partial, continue_final_message=True).prompt_text
    assert text.endswith("<|im_start|>assistant\nThe weather is")
    with invalid("continue_final_message"):
        renderer.render_chat(USER, continue_final_message=True)


def test_request_chat_template_refused_by_default(renderer: Renderer) -> None:
    with invalid("chat_template") as info:
        renderer.render_chat(USER, chat_template="{{ messages[0]['content'] }}")
    assert info.value.param == "chat_template"


def test_request_chat_template_when_allowed(permissive_renderer: Renderer) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{{ suffix }}"
    result = permissive_renderer.render_chat(
        USER, chat_template=template, chat_template_kwargs={"suffix": "!"}
    )
    assert result.prompt_text == "[user]What is the weather?!"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ messages['__class__'] }}",
        "{{ messages | attr('__class__') }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ messages | attr('_' ~ '_cla' ~ 'ss_' ~ '_') }}",
        "{% set n = '_' ~ '_class__' %}{{ (''|attr(n)).mro() }}",
    ],
)
def test_sandbox_escape_refused(permissive_renderer: Renderer, template: str) -> None:
    with invalid("chat_template", match="private attribute") as info:
        permissive_renderer.render_chat(USER, chat_template=template)
    assert info.value.param == "chat_template"


def test_sandbox_refuses_at_render_time(permissive_renderer: Renderer) -> None:
    # Nothing private is named, so only the immutable sandbox can refuse the mutation.
    template = "{% set m = messages %}{{ m.append(1) }}"
    with invalid("chat_template", match="refused by the sandbox") as info:
        permissive_renderer.render_chat(USER, chat_template=template)
    assert info.value.param == "chat_template"


def test_template_errors_are_invalid_argument(permissive_renderer: Renderer) -> None:
    with invalid("chat_template", match="not a valid Jinja template"):
        permissive_renderer.render_chat(USER, chat_template="{% for %}")
    with invalid("messages", match="boom"):
        permissive_renderer.render_chat(USER, chat_template="{{ raise_exception('boom') }}")


@pytest.mark.parametrize(
    ("kwargs", "match"), [([1], "JSON object"), ({"messages": []}, "messages"), ({"_x": 1}, "_x")]
)
def test_bad_chat_template_kwargs(renderer: Renderer, kwargs: Any, match: str) -> None:
    with invalid("chat_template_kwargs", match=match) as info:
        renderer.render_chat(USER, chat_template_kwargs=kwargs)
    assert info.value.param == "chat_template_kwargs"


def test_image_refused_when_model_has_no_image_token(renderer: Renderer, png_data_url: PngFactory) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": png_data_url()}},
            ],
        }
    ]
    with invalid("messages[0].content[1].image_url", match="does not accept image inputs") as info:
        renderer.render_chat(messages)
    assert info.value.param == "messages[0].content[1].image_url"


def test_images_expand_to_placeholder_runs(
    vlm_renderer: Renderer, png_data_url: PngFactory, image_seq_length: int
) -> None:
    spec = vlm_renderer.image_spec
    assert spec is not None and spec.seq_length == image_seq_length
    first, second = png_data_url((3, 2)), png_data_url((5, 4), (0, 0, 255))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": first}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": first},
            ],
        },
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": second}}]},
    ]
    result = vlm_renderer.render_chat(messages)
    assert result.prompt_text.count("<image>") == 3
    items = result.mm_items
    assert [item.shape for item in items] == [(2, 3, 3), (2, 3, 3), (4, 5, 3)]
    assert items[0].identifier == items[1].identifier != items[2].identifier
    for item in items:
        run = result.prompt_token_ids[item.offset : item.offset + item.length]
        assert run == [spec.token_id] * image_seq_length
        assert item.modality == "image" and item.dtype == "uint8"
        assert len(item.data) == item.shape[0] * item.shape[1] * 3
    assert result.prompt_token_ids.count(spec.token_id) == 3 * image_seq_length


def test_literal_image_token_without_image_refused(vlm_renderer: Renderer) -> None:
    with invalid("messages", match="image placeholder"):
        vlm_renderer.render_chat([{"role": "user", "content": "look: <image>"}])
    with invalid("prompt", match="image placeholder"):  # a completion prompt, as the gateway renders it
        _completion(vlm_renderer, text="<image>")


def _completion(
    renderer: Renderer, text: str | None = None, token_ids: list[int] | None = None, special: bool = True
) -> list[int]:
    """A completion prompt rendered as the gateway renders it, with this renderer's tokenizer."""
    return completion_token_ids(
        renderer.tokenizer, renderer.vocab_size, renderer.image_token, text, token_ids, special
    )


def test_completion_prompt(renderer: Renderer) -> None:
    by_text = _completion(renderer, text="Hello world", special=False)
    assert by_text == renderer.encode("Hello world", False)
    assert _completion(renderer, token_ids=by_text) == by_text
    for kwargs in ({"token_ids": [1, renderer.vocab_size]}, {"token_ids": [-1]}, {}, {"text": ""}):
        with invalid("prompt") as info:
            _completion(renderer, **kwargs)  # type: ignore[arg-type]
        assert info.value.param == "prompt"


def test_tokenize_detokenize_and_info(renderer: Renderer) -> None:
    ids, strs = renderer.tokenize("Hello 🎉", add_special_tokens=False, return_token_strs=True)
    assert len(strs) == len(ids) and renderer.detokenize(ids, skip_special_tokens=True) == "Hello 🎉"
    with invalid("token_ids"):
        renderer.detokenize([renderer.vocab_size + 5], skip_special_tokens=True)
    assert renderer.max_model_len == 2048
    assert renderer.eos_token_ids == [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>"), 0]
    assert renderer.has_chat_template and renderer.image_spec is None


def test_messages_json_round_trip_is_plain_json(renderer: Renderer) -> None:
    # The servicer hands decoded JSON straight to render_chat; unicode must survive.
    messages = json.loads(json.dumps([{"role": "user", "content": "naïve 你好"}]))
    assert "naïve 你好" in renderer.render_chat(messages).prompt_text
