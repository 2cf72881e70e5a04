"""Mistral tool calls: content, then `[TOOL_CALLS]` and either a JSON array of
`{"name": ..., "arguments": {...}}` (v3 tokenizers) or `name[ARGS]{...}` entries, each
after its own `[TOOL_CALLS]` (v11+). Content before the marker streams at once; from
the marker on the text is held until the end (given back as content if it does not
parse). The marker is a special token: the output is detokenized with special tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gateway.protocol import ToolCall
from gateway.tool_parsers.base import held_prefix, make_call

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"


@dataclass
class MistralToolParser:
    """See module docstring."""

    calls_emitted: int = 0
    _pending: str = ""
    _held: list[str] = field(default_factory=list)
    _in_calls: bool = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Consumes a text delta."""
        if self._in_calls:
            self._held.append(delta)
            return "", []
        text = self._pending + delta
        start = text.find(MARKER)
        if start >= 0:
            self._in_calls, self._pending = True, ""
            self._held.append(text[start:])
            return text[:start], []
        keep = held_prefix(text, MARKER)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Parses the held calls; unparsable text comes back as content."""
        text, self._held, pending, self._pending = "".join(self._held), [], self._pending, ""
        if not self._in_calls:
            return pending, []
        calls = parse_calls(text)
        if calls is None:
            return text, []
        self.calls_emitted += len(calls)
        return "", calls


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls after the marker(s), or None when they do not parse."""
    parts = [p.strip() for p in text.split(MARKER) if p.strip()]
    calls: list[ToolCall] = []
    for part in parts:
        if ARGS in part:
            name, args = part.split(ARGS, 1)
            call = make_call(name.strip(), _json(args))
            if call is None:
                return None
            calls.append(call)
            continue
        items = _json(part)
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list):
            return None
        for item in items:
            call = make_call(item.get("name"), item.get("arguments", {})) if isinstance(item, dict) else None
            if call is None:
                return None
            calls.append(call)
    return calls or None


def _json(text: str) -> object:
    """The JSON value at the start of `text` (what follows, e.g. an EOS token's text when
    special tokens are kept, is ignored)."""
    try:
        return json.JSONDecoder().raw_decode(text.strip())[0]
    except json.JSONDecodeError:
        return None
