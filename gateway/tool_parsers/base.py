"""The streaming interface every tool-call parser implements, and helpers they share."""

from __future__ import annotations

import json
from typing import Any, Protocol

from gateway.protocol import ToolCall, ToolCallFunction
from gateway.tools import new_call_id


class ToolParser(Protocol):
    """Incremental tool-call parser of one choice's output."""

    calls_emitted: int

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Consumes a text delta: (content to emit, completed calls)."""
        ...

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: held-back text that is content, and calls completed only now."""
        ...


def parse_whole(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A complete output split into content (None when empty) and tool calls."""
    content, calls = parser.feed(text)
    tail, more = parser.finish()
    content, calls = content + tail, calls + more
    if not calls:
        return text, []
    return (content.strip() or None), calls


def make_call(name: Any, arguments: Any) -> ToolCall | None:
    """A ToolCall from a parsed name and arguments (object or JSON string), or None."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return None
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return ToolCall(id=new_call_id(), function=ToolCallFunction(name=name, arguments=text))


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
