"""Tool calls outside the per-model parsers: Hermes-format helpers kept under their old
names (`parse_tool_calls`, `ToolCallStreamParser`: gateway.tool_parsers.hermes) and the
calls of a forced tool choice (`forced_tool_calls`).
"""

from __future__ import annotations

import json

from gateway.protocol import ChatCompletionRequest, NamedToolChoice, ToolCall, ToolCallFunction
from gateway.tool_parsers.base import new_call_id, parse_whole
from gateway.tool_parsers.hermes import END, START, ToolCallStreamParser

__all__ = ["END", "START", "ToolCallStreamParser", "forced_tool_calls", "new_call_id", "parse_tool_calls"]


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Splits a complete output into content (None when empty) and Hermes tool calls."""
    return parse_whole(ToolCallStreamParser(), text)


def forced_tool_calls(body: ChatCompletionRequest, text: str) -> tuple[str | None, list[ToolCall]]:
    """Calls of a forced tool choice's output (gateway.structured's schema): a named
    function's arguments object, or for "required" an array of {name, parameters}.
    Output that does not parse (cut by max_tokens) stays content."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    if isinstance(body.tool_choice, NamedToolChoice):
        name = body.tool_choice.function.name
        return None, [ToolCall(id=new_call_id(), function=ToolCallFunction(name=name, arguments=text))]
    if not isinstance(data, list):
        return text, []
    calls = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return text, []
        arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(
            ToolCall(id=new_call_id(), function=ToolCallFunction(name=item["name"], arguments=arguments))
        )
    return None, calls
