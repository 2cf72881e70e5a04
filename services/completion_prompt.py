"""A completion prompt as the model takes it: text tokenized, or token ids validated.

The gateway renders completion prompts in-process with the tokenizer files it already
holds for detokenizing (no round trip before the first token, as vLLM's frontend and
SGLang's router tokenize in-process); chat templates, tools and images stay in the
tokenizer service. The token-id and image-placeholder rules here are the ones the
tokenizer service and the engine apply too. No grpc here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from services.errors import InvalidArgument


@dataclass(frozen=True)
class ImageToken:
    """The placeholder token a vision model's prompts may hold only next to an image."""

    token_id: int
    token: str


def first_outside_vocab(
    tokens: Sequence[object], vocab_size: int, *, ints: bool = False
) -> tuple[int, object] | None:
    """(index, entry) of the first entry of `tokens` that is not a token id of a
    vocabulary of `vocab_size` (an int in [0, vocab_size); a bool is not one), or None.
    The gateway's, the tokenizer service's and the engine's check. With `ints` the
    entries are ints by construction (a validated request, a protobuf field) and only
    their range is checked, which skips the per-entry type test."""
    # The common case runs in C loops (min/max over the ids); the Python loop only finds
    # the offender (and lets int subclasses other than bool through).
    if not tokens:
        return None
    if ints or set(map(type, tokens)) == {int}:
        ids = cast(Sequence[int], tokens)
        if min(ids) >= 0 and max(ids) < vocab_size:
            return None
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            return i, token
    return None


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Raises InvalidArgument naming `param` for an id outside [0, vocab_size) (`token_ids`
    are ints: a validated request's, a protobuf field's, a tokenizer's output)."""
    bad = first_outside_vocab(token_ids, vocab_size, ints=True)
    if bad is not None:
        index, token_id = bad
        raise InvalidArgument(
            f"{param}[{index}] = {token_id} is outside the vocabulary [0, {vocab_size})", param=param
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
