"""Prompt rendering on top of a Hugging Face tokenizer: chat templates (sandboxed Jinja),
tools, image parts, completion prompts, tokenize and detokenize.

Domain code: no grpc, so it unit-tests without a server. Bad input raises `ValueError` or
`services.errors.InvalidArgument` naming the request field. Everything here is
synchronous and CPU-bound; the servicer runs it in worker threads.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2.exceptions import SecurityError, TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.completion_prompt import ImageToken, check_token_ids, refuse_image_token
from services.errors import InvalidArgument
from services.image_preprocess import ImagePreprocessor
from services.model_files import eos_token_ids, read_json
from tokenizer_svc.messages import (
    ParsedMessages,
    apply_tool_choice,
    parse_messages,
    parse_template_kwargs,
    parse_tools,
)
from tokenizer_svc.multimodal import (
    ImageData,
    MediaPolicy,
    MultiModalItem,
    expand_image_placeholders,
    find_image_token_spec,
    load_image,
    with_pixel_values,
)
from tokenizer_svc.templates import check_template

log = logging.getLogger(__name__)

_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
# Tokenizers without a real limit report a huge sentinel as model_max_length.
_NO_LIMIT = 10**9


@dataclass(frozen=True)
class RenderOptions:
    """Renderer policy, from the service config."""

    allow_request_chat_template: bool = False
    media: MediaPolicy = field(default_factory=MediaPolicy)
    # 0 = from the model's config.json.
    max_model_len: int = 0


@dataclass(frozen=True)
class RenderResult:
    """A rendered prompt: token ids, its text and the multimodal items placed in it."""

    prompt_token_ids: list[int]
    prompt_text: str
    mm_items: list[MultiModalItem] = field(default_factory=list)


def resolve_max_model_len(model_dir: Path, tokenizer: PreTrainedTokenizerBase, override: int) -> int:
    """The context length: `override` when > 0, else the model config's
    max_position_embeddings (or equivalent), else the tokenizer's model_max_length."""
    if override > 0:
        return override
    config = read_json(model_dir / "config.json")
    for section in (config, config.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in _MAX_LEN_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", 0)
    if isinstance(limit, int) and 0 < limit < _NO_LIMIT:
        return limit
    raise ValueError(f"cannot determine max_model_len from {model_dir}/config.json; set --max-model-len")


def resolve_eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from generation_config.json (int or list) then the tokenizer, deduplicated."""
    return eos_token_ids(model_dir, tokenizer.eos_token_id)


def _reserved_template_kwargs(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    names = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    return frozenset(names | {"messages"})


def _generation_prompt(add_generation_prompt: bool | None, continue_final_message: bool) -> bool:
    if continue_final_message and add_generation_prompt:
        raise InvalidArgument(
            "add_generation_prompt and continue_final_message cannot both be true",
            param="add_generation_prompt, continue_final_message",
        )
    if add_generation_prompt is None:
        return not continue_final_message
    return add_generation_prompt


def _check_continuable(parsed: ParsedMessages) -> None:
    last = parsed.messages[-1]
    content = last.get("content")
    has_text = isinstance(content, str) or (
        isinstance(content, list) and any(part.get("type") == "text" for part in content)
    )
    if last["role"] != "assistant" or not has_text:
        raise InvalidArgument(
            "continue_final_message requires the last message to be an assistant message with text content",
            param="continue_final_message",
        )


class Renderer:
    """Renders chat/completion prompts and (de)tokenizes with one model's tokenizer."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, model_dir: str | Path, options: RenderOptions
    ) -> None:
        self.tokenizer = tokenizer
        self.options = options
        directory = Path(model_dir)
        # Where the tokenizer files are (served to gateways by GetTokenizer).
        self.model_dir = directory
        self.vocab_size = len(tokenizer)
        self.max_model_len = resolve_max_model_len(directory, tokenizer, options.max_model_len)
        self.eos_token_ids = resolve_eos_token_ids(directory, tokenizer)
        self.image_spec = find_image_token_spec(tokenizer, directory)
        # The model's image processor: images leave as pixel values (None: raw RGB pixels).
        self.image_preprocessor = ImagePreprocessor.from_model_dir(directory) if self.image_spec else None
        self._reserved_kwargs = _reserved_template_kwargs(tokenizer)
        # The first encode may reset truncation/padding left in tokenizer.json (a mutation of
        # the Rust tokenizer); do it now, before worker threads share the tokenizer.
        self.encode("warm up", add_special_tokens=True)

    @classmethod
    def load(cls, model_dir: str | Path, options: RenderOptions | None = None) -> Renderer:
        """Loads the tokenizer of a Hugging Face model directory (offline)."""
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(tokenizer, model_dir, options or RenderOptions())

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    # -- chat ------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Any,
        tools: Any = None,
        tool_choice: Any = None,
        chat_template: str | None = None,
        chat_template_kwargs: Any = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> RenderResult:
        """Renders OpenAI chat `messages` (decoded JSON) through the chat template.

        `add_generation_prompt=None` means true unless `continue_final_message`. Tools are
        hidden from the template when `tool_choice` is "none". Image parts are decoded and
        their placeholder token expanded (InvalidArgument if the model takes no images).
        """
        parsed = parse_messages(messages)
        shown_tools = apply_tool_choice(parse_tools(tools), tool_choice)
        template = self._resolve_template(chat_template, shown_tools)
        kwargs = parse_template_kwargs(chat_template_kwargs, self._reserved_kwargs)
        add_prompt = _generation_prompt(add_generation_prompt, continue_final_message)
        if continue_final_message:
            _check_continuable(parsed)
        images = self._load_images(parsed)
        text = self._apply_template(
            parsed.messages, shown_tools, template, kwargs, add_prompt, continue_final_message
        )
        token_ids = self.encode(text, add_special_tokens)
        if not images:
            self._refuse_image_tokens(token_ids, "messages")
            return RenderResult(token_ids, text)
        if self.image_spec is None:  # checked in _load_images; keeps mypy informed
            raise InvalidArgument("model does not accept image inputs", param="messages")
        expanded, items = expand_image_placeholders(token_ids, images, self.image_spec)
        return RenderResult(expanded, text, with_pixel_values(items, images, self.image_preprocessor))

    def _resolve_template(self, chat_template: str | None, tools: list[dict[str, Any]] | None) -> str:
        if chat_template:
            if not self.options.allow_request_chat_template:
                raise InvalidArgument(
                    "chat_template in requests is not allowed on this server (allow_request_chat_template)",
                    param="chat_template",
                )
            check_template(chat_template)
            return chat_template
        try:
            return str(self.tokenizer.get_chat_template(None, tools))
        except ValueError as exc:
            raise InvalidArgument("the model has no chat template", param="chat_template") from exc

    def _load_images(self, parsed: ParsedMessages) -> list[ImageData]:
        if not parsed.images:
            return []
        if self.image_spec is None:
            first = parsed.images[0].field
            raise InvalidArgument(f"{first}: model does not accept image inputs", param=first)
        return [load_image(ref.url, ref.field, self.options.media) for ref in parsed.images]

    def _apply_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str,
        kwargs: dict[str, Any],
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> str:
        template_tools: list[dict[Any, Any] | Callable[..., Any]] | None = (
            list(tools) if tools is not None else None
        )
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages,
                tools=template_tools,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except SecurityError as exc:
            raise InvalidArgument(
                f"chat_template refused by the sandbox: {exc}", param="chat_template"
            ) from exc
        except (
            TemplateError,
            TypeError,
            ValueError,
            ArithmeticError,
            LookupError,
            AttributeError,
            RecursionError,
        ) as exc:
            # Whatever a (possibly request-supplied) template raises while rendering is
            # a property of the request, not a server failure.
            raise InvalidArgument(
                f"chat template could not render the messages: {exc}", param="messages"
            ) from exc
        if not isinstance(rendered, str):
            raise TypeError(f"apply_chat_template returned {type(rendered).__name__}, expected str")
        return rendered

    @property
    def image_token(self) -> ImageToken | None:
        """The image placeholder (None for a text-only model)."""
        spec = self.image_spec
        return None if spec is None else ImageToken(spec.token_id, spec.token)

    def _refuse_image_tokens(self, token_ids: Sequence[int], param: str) -> None:
        refuse_image_token(token_ids, self.image_token, param)

    # -- completion, tokenize, detokenize --------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text` (never truncated)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def tokenize(
        self, text: str, add_special_tokens: bool, return_token_strs: bool = False
    ) -> tuple[list[int], list[str]]:
        """Token ids of `text` and, on request, their token strings."""
        ids = self.encode(text, add_special_tokens)
        if not return_token_strs:
            return ids, []
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        return ids, [str(t) for t in (tokens if isinstance(tokens, list) else [tokens])]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        """The text of `token_ids` (ids must be validated by the caller)."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        """Validates `token_ids` (field `token_ids`) and decodes them."""
        self.validate_token_ids(token_ids, "token_ids")
        return self.decode(token_ids, skip_special_tokens)

    def validate_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        """Raises InvalidArgument naming `param` for an id outside [0, vocab_size)."""
        check_token_ids(token_ids, self.vocab_size, param)
