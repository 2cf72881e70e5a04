"""Llama 3.x JSON tool calls: the output IS the call(s) -- `{"name": ..., "parameters":
{...}}`, optionally after `<|python_tag|>`, several separated by `;`. Output that starts
otherwise is content and streams at once; output that starts like a call is held until
the end and given back as content if it does not parse."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gateway.protocol import ToolCall
from gateway.tool_parsers.base import held_prefix, make_call

PYTHON_TAG = "<|python_tag|>"


@dataclass
class Llama3JsonToolParser:
    """See module docstring."""

    calls_emitted: int = 0
    _buffer: list[str] = field(default_factory=list)
    _mode: str = "undecided"  # undecided | content | calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Consumes a text delta."""
        if self._mode == "content":
            return delta, []
        self._buffer.append(delta)
        if self._mode == "calls":
            return "", []
        text = "".join(self._buffer).lstrip()
        if text.startswith(PYTHON_TAG) or text.startswith("{"):
            self._mode = "calls"
            return "", []
        if not text or held_prefix(text, PYTHON_TAG) == len(text):
            return "", []  # only whitespace or a partial python tag so far
        self._mode = "content"
        held, self._buffer = "".join(self._buffer), []
        return held, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Parses the held calls; unparsable text comes back as content."""
        text, self._buffer = "".join(self._buffer), []
        if self._mode != "calls":
            return text, []
        calls = parse_calls(text)
        if calls is None:
            return text, []
        self.calls_emitted += len(calls)
        return "", calls


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of a whole output, or None when it is not only calls."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    calls = []
    decoder = json.JSONDecoder()
    rest = body.strip()
    # Stops at what is not a call (e.g. <|eot_id|> when special tokens are kept).
    while rest.startswith("{"):
        try:
            obj, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        call = make_call(obj.get("name"), obj.get("parameters", obj.get("arguments", {})))
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].strip()
        if rest.startswith(";"):
            rest = rest[1:].strip()
    return calls or None
