"""Reasoning parsers: the `<think>...</think>` section of a reasoning model's output goes
to `reasoning_content` (message and deltas, as vLLM sends it), the rest to `content`.
Chosen by the gateway's `--reasoning-parser` (empty = none):

- `qwen3`: reasoning only when the output opens with `<think>` (Qwen3 with thinking on).
- `deepseek_r1`: the chat template already opened `<think>` in the prompt, so the output
  starts inside the reasoning (an opening `<think>` is tolerated); without `</think>`
  the whole output is reasoning.

Tags split across deltas are held back until they can be told apart from text.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def check_name(name: str) -> None:
    """ValueError naming the option for an unknown parser."""
    if name and name not in PARSERS:
        raise ValueError(f"reasoning_parser must be empty or one of {', '.join(PARSERS)}, got {name!r}")


def _held(text: str, tag: str) -> int:
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ReasoningParser:
    """Streaming split of one choice's output: `feed(delta)` -> (reasoning, content)."""

    name: str
    _state: str = "start"  # start | reasoning | after (newlines after </think> dropped) | content
    _pending: str = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """Consumes a text delta."""
        text = self._pending + delta
        self._pending = ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(START):
                self._state, text = "reasoning", stripped[len(START) :]
            elif len(stripped) < len(START) and START.startswith(stripped):
                self._pending = text  # could still become <think>
                return "", ""
            else:
                self._state = "reasoning" if self.name == "deepseek_r1" else "content"
        if self._state == "after":
            text = text.lstrip("\n")
            if text:
                self._state = "content"
            return "", text
        if self._state == "content":
            return "", text
        end = text.find(END)
        if end >= 0:
            self._state = "after"
            thoughts, rest = text[:end], text[end + len(END) :]
            return thoughts, self.feed(rest)[1] if rest else ""
        keep = _held(text, END)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """End of output: held-back text (reasoning or content, by the current state)."""
        text, self._pending = self._pending, ""
        if self._state == "reasoning" or (self._state == "start" and self.name == "deepseek_r1"):
            return text, ""
        return "", text


def split(name: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a complete output; None for an empty part."""
    parser = ReasoningParser(name)
    reasoning, content = parser.feed(text)
    more_r, more_c = parser.finish()
    reasoning, content = reasoning + more_r, content + more_c
    return reasoning or None, content or None
