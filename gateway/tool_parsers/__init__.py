"""Tool-call parsers, one per model family's output format, chosen by the gateway's
`--tool-call-parser` (one name for every model, or `model=name,...` per model).

Every parser has the same streaming interface (`ToolParser`, gateway.tool_parsers.base):
`feed(delta)` returns (content to emit, `ToolCallDelta`s: a call's header once its name
is known, then its arguments text in fragments as they arrive), `finish()` the held-back
content and last deltas at the end of the output, `calls` the calls completed so far.
Text that turns out not to be a valid call is given back as content, never dropped.

- `hermes` (alias `qwen`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text (Hermes 2/3, Qwen 2.5/3).
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`, several separated by `;`), as Llama 3.1-3.3 call tools.
- `mistral`: `[TOOL_CALLS]` followed by a JSON array of `{"name", "arguments"}` or by
  `name[ARGS]{...}` entries (v11+ tokenizers).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.tool_parsers.base import ToolCallDelta, ToolParser, parse_whole
from gateway.tool_parsers.hermes import ToolCallStreamParser
from gateway.tool_parsers.llama3 import Llama3JsonToolParser
from gateway.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": ToolCallStreamParser,
    "qwen": ToolCallStreamParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
# Parsers whose markers are special tokens: the output must be detokenized with them.
NEEDS_SPECIAL_TOKENS = frozenset({"llama3_json", "mistral"})

__all__ = [
    "NEEDS_SPECIAL_TOKENS",
    "PARSERS",
    "ToolCallDelta",
    "ToolParser",
    "check_spec",
    "parse_whole",
    "parser_name_for",
]


def _entries(spec: str) -> tuple[str | None, dict[str, str]]:
    """(default parser, {model: parser}) of a `--tool-call-parser` value."""
    default: str | None = None
    per_model: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "=" in part:
            model, name = (s.strip() for s in part.split("=", 1))
            per_model[model] = name
        else:
            default = part
    return default, per_model


def check_spec(spec: str) -> None:
    """ValueError naming the option when a parser name is unknown."""
    default, per_model = _entries(spec)
    for name in [default, *per_model.values()]:
        if name is not None and name not in PARSERS:
            raise ValueError(
                f"tool_call_parser: unknown parser {name!r} (known: {', '.join(sorted(PARSERS))})"
            )


def parser_name_for(spec: str, model: str) -> str:
    """The parser configured for `model` (hermes when none is)."""
    default, per_model = _entries(spec)
    return per_model.get(model, default or "hermes")
