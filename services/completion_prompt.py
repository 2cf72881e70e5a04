"""A completion prompt as the model takes it: text tokenized, or token ids validated.

One function for the tokenizer service (`RenderCompletion`) and the gateway, which
renders text-only completion prompts in-process with the tokenizer files it already
holds for detokenizing (one round trip less before the first token, as vLLM's frontend
and SGLang's router tokenize in-process). Chat templates, tools and images stay in the
tokenizer service. No grpc here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.errors import InvalidArgument


@dataclass(frozen=True)
class ImageToken:
    """The placeholder token a vision model's prompts may hold only next to an image."""

    token_id: int
    token: str


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Raises InvalidArgument naming `param` for an id outside [0, vocab_size)."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return  # min/max run in C: a long prompt costs no Python loop
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(
                f"{param}[{i}] = {token_id} is outside the vocabulary [0, {vocab_size})", param=param
            )


def refuse_image_token(token_ids: Sequence[int], image: ImageToken | None, param: str) -> None:
    """A prompt that holds the image placeholder without an image is refused (the
    model would read an image embedding that is not there)."""
    if image is not None and image.token_id in token_ids:
        raise InvalidArgument(
            f"{param} contains the image placeholder {image.token!r} without an image", param=param
        )


def completion_token_ids(
    tokenizer: Any,
    vocab_size: int,
    image: ImageToken | None,
    text: str | None,
    token_ids: Sequence[int] | None,
    add_special_tokens: bool,
) -> list[int]:
    """The prompt's token ids: `text` tokenized (never truncated), or `token_ids`
    checked against the vocabulary. Field `prompt` is named in every error."""
    if text is not None:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    elif token_ids is not None:
        ids = list(token_ids)
        check_token_ids(ids, vocab_size, "prompt")
    else:
        raise InvalidArgument("prompt is required (text or token_ids)", param="prompt")
    if not ids:
        raise InvalidArgument("prompt must not be empty", param="prompt")
    refuse_image_token(ids, image, "prompt")
    return ids
