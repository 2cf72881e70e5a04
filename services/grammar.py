"""The structured-output grammar rule, one for the gateway (checks a request's constraint
before routing) and the worker (compiles and enforces it): what each kind means and how
it becomes an llguidance grammar. What passes the gateway's check compiles on a worker.

Why llguidance: docs/design-decisions.md, "llguidance for structured outputs".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Compact separators, no free whitespace: a random-weight model cannot run off into
# endless spaces, and the output is what `json.dumps` of the object would be.
JSON_DEFAULTS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredSpec:
    """The constraint of a request: ``kind`` in :data:`KINDS` and its ``spec`` text
    (JSON schema / regex / JSON list of strings / Lark grammar; unused for json_object)."""

    kind: str
    spec: str = ""

    def grammar(self, field: str = "") -> str:
        """The llguidance grammar; ValueError naming ``field`` (default
        ``structured_outputs.<kind>``) when the spec is malformed."""
        from llguidance import LLMatcher

        field = field or f"structured_outputs.{self.kind}"
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{field} is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(f"{field} must be a JSON schema object")
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_DEFAULTS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return LLMatcher.grammar_from_lark(_choice_lark(self.spec, field))
        return LLMatcher.grammar_from_lark(self.spec)

    def validate(self, field: str = "") -> str:
        """The grammar, checked without a tokenizer (cheap): ValueError naming the field."""
        from llguidance import LLMatcher

        field = field or f"structured_outputs.{self.kind}"
        try:
            grammar = self.grammar(field)
            error = LLMatcher.validate_grammar(grammar)
        except ValueError as exc:
            if str(exc).startswith(field) or str(exc).startswith("structured_outputs kind"):
                raise
            error = str(exc)  # llguidance's own parse error of a regex or Lark grammar
        if error:
            raise ValueError(f"{field} is invalid: {error.strip()[:500]}")
        return grammar


def _choice_lark(spec: str, field: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field} is not a JSON list: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"{field} must be a non-empty list of non-empty strings")
    # JSON string literals are valid Lark literals (same escapes).
    return "start: " + " | ".join(json.dumps(c) for c in choices)
