"""The streaming interface every tool-call parser implements, and what they share.

A parser turns one choice's output text, delta by delta, into content and
`ToolCallDelta`s as OpenAI streams a call: a header (index, id, name, arguments "") as
soon as the name is known, then the arguments text in fragments as it arrives
(gateway.tool_parsers.json_stream: canonical json.dumps text). `calls` holds the calls
completed so far (what the non-streamed response returns, same ids and arguments).

A call that turns out invalid (bad JSON, not a call, or the output ends before it
closes -- e.g. cut by max_tokens) is given back as content: every character since the
last completed call, from its marker on, comes back in `feed`/`finish` content. Its
header and argument fragments may already have been streamed; they are never completed
(no closing fragment is invented), the call is not in `calls`, and it does not make the
finish reason "tool_calls".
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Protocol

from gateway.protocol import ToolCall, ToolCallFunction
from gateway.tool_parsers.json_stream import CallBuilder, InvalidCall, JsonTokens


def new_call_id() -> str:
    """An OpenAI-style tool call id, `call_<hex>`."""
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: the header (id and name set, arguments "") or an
    arguments fragment of call `index`."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


class ToolParser(Protocol):
    """Incremental tool-call parser of one choice's output."""

    calls: list[ToolCall]

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Consumes a text delta: (content to emit, call deltas)."""
        ...

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: held-back text that is content, and the last call deltas."""
        ...


def parse_whole(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A complete output split into content (None when empty) and tool calls."""
    content, _ = parser.feed(text)
    tail, _ = parser.finish()
    content += tail
    if not parser.calls:
        return text, []
    return (content.strip() or None), list(parser.calls)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class CallStream:
    """Calls under way in one parser: numbering, headers, fragments, completion."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.out: list[ToolCallDelta] = []
        self._announced = 0
        self._builder: CallBuilder | None = None
        self._id = ""
        self._index: int | None = None
        self._sent = 0

    @property
    def active(self) -> bool:
        """Whether a call is under way."""
        return self._builder is not None

    def begin(self, builder: CallBuilder) -> None:
        """Starts a call (its header goes out once its name is known)."""
        self._builder, self._id, self._index, self._sent = builder, new_call_id(), None, 0
        self.pump()

    def pump(self) -> None:
        """Sends what the current call has that was not sent; completes it once closed."""
        builder = self._builder
        if builder is None or builder.name is None:
            return
        if self._index is None:
            self._index, self._announced = self._announced, self._announced + 1
            self.out.append(ToolCallDelta(self._index, "", self._id, builder.name))
        if len(builder.args) > self._sent:
            text = "".join(builder.args[self._sent :])
            self._sent = len(builder.args)
            if text:
                self.out.append(ToolCallDelta(self._index, text))
        if builder.closed:
            arguments = "".join(builder.args)
            self.calls.append(
                ToolCall(id=self._id, function=ToolCallFunction(name=builder.name, arguments=arguments))
            )
            self._builder = None

    def drop(self) -> None:
        """The current call turned out invalid: forget it (the caller keeps its text)."""
        self._builder = None

    def take(self) -> list[ToolCallDelta]:
        """The deltas produced since the last take."""
        out, self.out = self.out, []
        return out


class ScanningParser:
    """What the marker/JSON parsers share: `feed` runs the parser's state methods
    (`_<state>(text, content) -> rest of text`) until the delta is used up; a state that
    needs more text keeps it in `_pending`. A call's JSON goes through `_feed_json`."""

    def __init__(self, state: str) -> None:
        """Starts in `state`, no call streamed yet."""
        self._stream = CallStream()
        self.calls: list[ToolCall] = self._stream.calls
        self._state = state
        self._pending = ""
        self._tokens = JsonTokens()

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Consumes a text delta: (content, call deltas)."""
        text = self._pending + delta
        self._pending = ""
        content: list[str] = []
        while text:
            text = getattr(self, f"_{self._state}")(text, content)
        return "".join(content), self._stream.take()

    def _up_to(self, marker: str, text: str, content: list[str]) -> int:
        """The index of `marker` in `text`, what precedes it appended to content; -1 when
        absent (then all but a possible start of the marker is content, that start held)."""
        start = text.find(marker)
        if start < 0:
            keep = held_prefix(text, marker)
            content.append(text[: len(text) - keep])
            self._pending = text[len(text) - keep :]
            return -1
        content.append(text[:start])
        return start

    def _feed_json(self, builder: CallBuilder, text: str) -> int:
        """Feeds `text` to the open call's JSON object (`_tokens`, built by `builder`):
        how much of it the object took. InvalidCall when the text breaks the call."""
        used, tokens = self._tokens.feed(text)
        for token in tokens:
            builder.token(*token)
        return used


class RawCallParser(ScanningParser):
    """A ScanningParser whose failed call gives back as content every character since the
    last completed call (`_raw`), and whose calls are JSON objects fed to a `CallBuilder`."""

    def __init__(self, state: str, builder: CallBuilder | None) -> None:
        """Starts in `state` with `builder` for the first call (None: none open)."""
        super().__init__(state)
        self._raw = ""  # text since the last completed call (content if the next fails)
        self._builder = builder

    def _feed_call(self, text: str, content: list[str]) -> str:
        """Feeds one call object's JSON; back to "between" once it is complete."""
        if self._builder is None:
            raise RuntimeError("no call is open")
        try:
            used = self._feed_json(self._builder, text)
        except InvalidCall:
            return self._fail(text, content)
        self._raw += text[:used]
        self._stream.pump()
        if self._tokens.done:
            self._state, self._raw = "between", ""
        return text[used:]

    def _fail(self, text: str, content: list[str]) -> str:
        self._stream.drop()
        content.append(self._raw)
        self._state, self._raw = "content", ""
        return text
