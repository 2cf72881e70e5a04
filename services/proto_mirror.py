"""Domain objects that mirror a proto message field for field (an engine's load and its
LoRA adapters, a rendered prompt's images, the scheduler's snapshot of a worker's load)
are copied to and from it here, by the message's own field names: a field added to the
message is one every mirror must have, not one a copy forgets."""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf.message import Message

__all__ = ["fields_of", "mirrored"]

M = TypeVar("M", bound=Message)


def fields_of(message_type: type[Message], source: object) -> dict[str, Any]:
    """Every field of `message_type`, by name, read from the same-named attribute of
    `source` (a message of that type, or a mirror of it)."""
    return {field.name: getattr(source, field.name) for field in message_type.DESCRIPTOR.fields}


def mirrored(message_type: type[M], source: object) -> M:
    """A `message_type` with every field copied from `source` (see `fields_of`)."""
    return message_type(**fields_of(message_type, source))
