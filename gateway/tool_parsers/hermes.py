"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks anywhere in the text. Text outside blocks streams at once (a possible start of
`<tool_call>` is held back); inside a block the call is streamed as its JSON arrives
(header once the name is known, then argument fragments). The call is complete when its
JSON object closes; the `</tool_call>` after it is consumed. A block whose JSON turns
out invalid is content, from `<tool_call>` through its `</tool_call>` (or the end)."""

from __future__ import annotations

from gateway.tool_parsers.base import ScanningParser, ToolCallDelta
from gateway.tool_parsers.json_stream import CallBuilder, InvalidCall, JsonTokens

START = "<tool_call>"
END = "</tool_call>"


class ToolCallStreamParser(ScanningParser):
    """See module docstring (the `ToolParser` interface)."""

    def __init__(self) -> None:
        super().__init__("text")  # text | json | after | bad
        self._raw: list[str] = []
        self._builder = CallBuilder()

    def _text(self, text: str, content: list[str]) -> str:
        start = self._up_to(START, text, content)
        if start < 0:
            return ""
        self._state, self._raw = "json", [START]
        self._tokens, self._builder = JsonTokens(), CallBuilder()
        self._stream.begin(self._builder)
        return text[start + len(START) :]

    def _json(self, text: str, content: list[str]) -> str:
        try:
            used = self._feed_json(self._builder, text)
        except InvalidCall:
            # Not a call: the block is content through its </tool_call>.
            self._stream.drop()
            self._state, bad, self._raw = "bad", "".join(self._raw), []
            return bad + text
        self._raw.append(text[:used])
        self._stream.pump()
        if self._tokens.done:
            self._state = "after"
        return text[used:]

    def _after(self, text: str, content: list[str]) -> str:
        stripped = text.lstrip()
        if stripped.startswith(END):
            self._state = "text"
            return stripped[len(END) :]
        if END.startswith(stripped):
            self._pending = text
            return ""
        self._state = "text"
        return text

    def _bad(self, text: str, content: list[str]) -> str:
        end = text.find(END)
        if end < 0:
            self._pending = text
            return ""
        content.append(text[: end + len(END)])
        self._state = "text"
        return text[end + len(END) :]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: held text is content; a call still open is content too."""
        tail = self._pending
        if self._state == "json":
            self._stream.drop()
            tail = "".join(self._raw) + tail
        self._state, self._pending, self._raw = "text", "", []
        return tail, self._stream.take()
