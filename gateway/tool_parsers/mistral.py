"""Mistral tool calls: content, then `[TOOL_CALLS]` and either a JSON array of
`{"name": ..., "arguments": {...}}` (v3 tokenizers; a single object is accepted too) or
`name[ARGS]{...}` entries, each after its own `[TOOL_CALLS]` (v11+). Content before the
marker streams at once; the calls stream as their JSON arrives (the name of the v11 form
is known at `[ARGS]`). From the first text that breaks a call on, everything since the
last completed call (from the marker on) is content. A trailing `</s>` (the output is
detokenized with special tokens: the marker is one) is dropped; other text is content."""

from __future__ import annotations

import re

from gateway.tool_parsers.base import RawCallParser, ToolCallDelta, held_prefix
from gateway.tool_parsers.json_stream import CallBuilder, InvalidCall, JsonTokens

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
EOS = "</s>"
_NAME = re.compile(r"[\w.\-]*\Z")


class MistralToolParser(RawCallParser):
    """See module docstring (the `ToolParser` interface)."""

    def __init__(self) -> None:
        # States: text | marker | name | array | json | between | tail | content; the raw
        # text of a failed call runs from the marker on.
        super().__init__("text", None)

    def _text(self, text: str, content: list[str]) -> str:
        start = self._up_to(MARKER, text, content)
        if start < 0:
            return ""
        self._state, self._raw = "marker", MARKER
        return text[start + len(MARKER) :]

    def _marker(self, text: str, content: list[str]) -> str:
        body = text.lstrip()
        if not body:
            self._pending = text
            return ""
        self._raw += text[: len(text) - len(body)]
        self._tokens = JsonTokens()
        if body[0] == "[":
            self._state, self._builder = "array", None
        elif body[0] == "{":
            self._state, self._builder = "json", CallBuilder()
            self._stream.begin(self._builder)
        else:
            self._state = "name"
        return body

    def _name(self, text: str, content: list[str]) -> str:
        at = text.find(ARGS)
        name = text[: len(text) - held_prefix(text, ARGS)] if at < 0 else text[:at]
        if not _NAME.match(name.strip()) or (at >= 0 and not name.strip()):
            return self._fail(text, content)
        if at < 0:
            self._pending = text  # the name so far (a partial [ARGS] included)
            return ""
        self._raw += text[: at + len(ARGS)]
        self._state, self._builder = "json", CallBuilder(name=name.strip())
        self._stream.begin(self._builder)
        return text[at + len(ARGS) :]

    def _json(self, text: str, content: list[str]) -> str:
        """One call object (or the arguments object of `name[ARGS]`)."""
        return self._feed_call(text, content)

    def _array(self, text: str, content: list[str]) -> str:
        """A JSON array of call objects, a character at a time (a call's end is exact)."""
        for i, ch in enumerate(text):
            try:
                _, tokens = self._tokens.feed(ch)
                for kind, value, depth in tokens:
                    if self._builder is None:
                        if kind == "{" and depth == 1:
                            self._builder = CallBuilder(depth=1)
                            self._stream.begin(self._builder)
                        elif (kind, depth) not in (("[", 0), (",", 1), ("]", 0)):
                            raise InvalidCall("the array holds something else than calls")
                    if self._builder is not None:
                        self._builder.token(kind, value, depth)
            except InvalidCall:
                return self._fail(text[i:], content)
            self._raw += ch
            self._stream.pump()
            if self._builder is not None and self._builder.closed:
                self._builder, self._raw = None, ""
            if self._tokens.done:
                self._state, self._raw = "between", ""
                return text[i + 1 :]
        return ""

    def _between(self, text: str, content: list[str]) -> str:
        body = text.lstrip()
        if not body or held_prefix(body, MARKER) == len(body):
            self._pending = text
            return ""
        if body.startswith(MARKER):
            self._state, self._raw = "marker", text[: len(text) - len(body)] + MARKER
            return body[len(MARKER) :]
        self._state = "tail"
        return text

    def _tail(self, text: str, content: list[str]) -> str:
        self._pending = text  # after the calls: held until the end (see finish)
        return ""

    def _content(self, text: str, content: list[str]) -> str:
        content.append(text)
        return ""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: held text is content; a call still open is content too."""
        tail, state = self._pending, self._state
        if state in ("marker", "name", "json", "array"):
            self._stream.drop()
            tail = self._raw + tail
        elif state in ("between", "tail"):
            tail = tail.strip().removesuffix(EOS).strip()
        self._state, self._pending, self._raw = "content", "", ""
        return tail, self._stream.take()
