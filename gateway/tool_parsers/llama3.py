"""Llama 3.x JSON tool calls: the output IS the call(s) -- `{"name": ..., "parameters":
{...}}`, optionally after `<|python_tag|>`, several separated by `;`. Output that starts
otherwise is content and streams at once; output that starts like a call is streamed as
calls as its JSON arrives. From the first text that breaks a call on, everything since
the last completed call is content. After the calls, `<|eot_id|>` / `<|eom_id|>` (kept
because the output is detokenized with special tokens) are dropped; other text is content."""

from __future__ import annotations

from gateway.tool_parsers.base import RawCallParser, ToolCallDelta, held_prefix
from gateway.tool_parsers.json_stream import CallBuilder, JsonTokens

PYTHON_TAG = "<|python_tag|>"
END_MARKERS = ("<|eot_id|>", "<|eom_id|>")


class Llama3JsonToolParser(RawCallParser):
    """See module docstring (the `ToolParser` interface)."""

    def __init__(self) -> None:
        super().__init__("undecided", CallBuilder())  # undecided | between | call | tail | content

    def _undecided(self, text: str, content: list[str]) -> str:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            self._state, self._raw = "between", text[: len(text) - len(body) + len(PYTHON_TAG)]
            return body[len(PYTHON_TAG) :]
        if body.startswith("{"):
            self._state = "between"
            return text
        if not body or held_prefix(body, PYTHON_TAG) == len(body):
            self._pending = text  # only whitespace or a partial python tag so far
            return ""
        self._state = "content"
        return text

    def _content(self, text: str, content: list[str]) -> str:
        content.append(text)
        return ""

    def _between(self, text: str, content: list[str]) -> str:
        body = text.lstrip()
        if self.calls and body.startswith(";"):
            body = body[1:].lstrip()
        if not body:
            self._pending = text
            return ""
        self._raw += text[: len(text) - len(body)]
        if body.startswith("{"):
            self._state, self._tokens, self._builder = "call", JsonTokens(), CallBuilder()
            self._stream.begin(self._builder)
            return body
        if not self.calls:
            return self._fail(body, content)
        self._state = "tail"
        return body

    def _call(self, text: str, content: list[str]) -> str:
        return self._feed_call(text, content)

    def _tail(self, text: str, content: list[str]) -> str:
        self._pending = text  # after the calls: held until the end (see finish)
        return ""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: held text is content; a call still open is content too."""
        tail, state = self._pending, self._state
        if state == "call":
            self._stream.drop()
            tail = self._raw + tail
        elif state == "between" and not self.calls:
            tail = self._raw + tail
        elif state in ("between", "tail"):
            stripped = tail.strip()
            for marker in END_MARKERS:
                stripped = stripped.removesuffix(marker).strip()
            tail = stripped
        self._state, self._pending, self._raw = "content", "", ""
        return tail, self._stream.take()
