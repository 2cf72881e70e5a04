"""Hermes-format tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`parse_tool_calls` handles a whole text (non-streaming); `ToolCallStreamParser`
handles text deltas: plain text is passed through, text from `<tool_call>` on is held
back until the block closes, then emitted as one complete tool call. A block whose
JSON cannot be parsed (or that never closes) is returned as plain text.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from gateway.protocol import ChatCompletionRequest, NamedToolChoice, ToolCall, ToolCallFunction

START = "<tool_call>"
END = "</tool_call>"


def new_call_id() -> str:
    """An OpenAI-style tool call id, `call_<hex>`."""
    return f"call_{secrets.token_hex(12)}"


def parse_block(body: str) -> ToolCall | None:
    """The tool call in one block's body, or None when it is not a valid call."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        arguments_json = arguments
    else:
        arguments_json = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=ToolCallFunction(name=data["name"], arguments=arguments_json))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Splits a complete output into content (None when empty) and tool calls."""
    parser = ToolCallStreamParser()
    content, calls = parser.feed(text)
    content += parser.flush()
    if not calls:
        return text, []
    stripped = content.strip()
    return (stripped or None), calls


def _partial_start(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of START."""
    for size in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallStreamParser:
    """Incremental parser: `feed(delta)` → (content to emit, completed tool calls)."""

    _pending: str = ""
    _in_call: bool = False
    calls_emitted: int = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Consumes a text delta."""
        self._pending += delta
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._pending.find(END)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(END) :]
                self._in_call = False
                call = parse_block(body.strip())
                if call is None:
                    content.append(START + body + END)
                else:
                    calls.append(call)
                continue
            start = self._pending.find(START)
            if start < 0:
                keep = _partial_start(self._pending)
                content.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            content.append(self._pending[:start])
            self._pending = self._pending[start + len(START) :]
            self._in_call = True
        self.calls_emitted += len(calls)
        return "".join(content), calls

    def flush(self) -> str:
        """End of output: whatever is held back, as plain text."""
        text = (START if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output (the `ToolParser` interface): held text; calls all came in feed."""
        return self.flush(), []


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
