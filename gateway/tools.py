"""Tool calls outside the per-model parsers: Hermes-format helpers kept under their old
names (`parse_tool_calls`, `ToolCallStreamParser`: gateway.tool_parsers.hermes) and the
calls of a forced tool choice (`ForcedToolParser`, `forced_tool_calls`).
"""

from __future__ import annotations

from gateway.protocol import ChatCompletionRequest, NamedToolChoice, ToolCall
from gateway.tool_parsers.base import new_call_id, parse_whole
from gateway.tool_parsers.hermes import END, START, ToolCallStreamParser
from gateway.tool_parsers.json_stream import CallBuilder
from gateway.tool_parsers.mistral import MistralToolParser

__all__ = [
    "END",
    "START",
    "ForcedToolParser",
    "ToolCallStreamParser",
    "forced_tool_calls",
    "forced_tool_parser",
    "new_call_id",
    "parse_tool_calls",
]


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Splits a complete output into content (None when empty) and Hermes tool calls."""
    return parse_whole(ToolCallStreamParser(), text)


class ForcedToolParser(MistralToolParser):
    """The calls of a forced tool choice's output (gateway.structured's schema), streamed
    like any parser's: for a named function the output is its arguments object (the
    header goes out at once, then the arguments as they arrive); for "required" it is an
    array of `{"name": ..., "parameters": {...}}` (Mistral's array form without the
    marker). Output that does not parse (cut by max_tokens) is content."""

    def __init__(self, name: str | None) -> None:
        super().__init__()
        if name is None:
            self._state = "marker"
        else:
            self._state, self._builder = "json", CallBuilder(name=name)
            self._stream.begin(self._builder)


def forced_tool_parser(body: ChatCompletionRequest) -> ForcedToolParser:
    """The parser of a forced tool choice's output (one per choice)."""
    named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    return ForcedToolParser(named)


def forced_tool_calls(body: ChatCompletionRequest, text: str) -> tuple[str | None, list[ToolCall]]:
    """Content and calls of a forced tool choice's whole output (see ForcedToolParser)."""
    return parse_whole(forced_tool_parser(body), text)
