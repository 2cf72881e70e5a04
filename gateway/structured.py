"""Structured outputs in the gateway: the request's constraint as the proto's
(`structured_kind`, `structured_spec`), checked before routing so that a bad schema,
regex or grammar is a 400 naming the field and never reaches a worker.

Sources, first match wins: `response_format` (json_schema / json_object), vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object), and a forced tool
choice ("required" or a named function: the output is the calls' JSON, as vLLM does).
The worker enforces it while sampling (worker_svc/engine/structured.py) and checks it
again (INVALID_ARGUMENT); both build the grammar with services/grammar.py, so what passes
here compiles there.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, NamedToolChoice, SamplingRequest
from services.grammar import StructuredSpec


def constraint(body: SamplingRequest) -> tuple[str, str, str] | None:
    """(kind, spec, request field) of the body's output constraint, or None."""
    if isinstance(body, ChatCompletionRequest):
        found = _chat_constraint(body)
        if found is not None:
            return found
    so = body.structured_outputs
    if so is None:
        return None
    set_fields = [name for name in ("json_", "regex", "choice", "grammar") if getattr(so, name) is not None]
    if so.json_object:
        set_fields.append("json_object")
    if len(set_fields) != 1:
        raise APIError(
            400,
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
            param="structured_outputs",
        )
    name = set_fields[0]
    if name == "json_":
        value = so.json_
        return "json", value if isinstance(value, str) else json.dumps(value), "structured_outputs.json"
    if name == "choice":
        return "choice", json.dumps(so.choice), "structured_outputs.choice"
    if name == "json_object":
        return "json_object", "", "structured_outputs.json_object"
    return name, getattr(so, name), f"structured_outputs.{name}"


def _chat_constraint(body: ChatCompletionRequest) -> tuple[str, str, str] | None:
    if body.forced_tools():
        return "json", json.dumps(forced_tool_schema(body)), "tool_choice"
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "json_object", "", "response_format"
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    return "json", json.dumps(schema if schema is not None else {}), "response_format"


def forced_tool_schema(body: ChatCompletionRequest) -> dict[str, Any]:
    """The JSON the output must be: a named function's arguments object, or for
    "required" a non-empty array of `{"name": ..., "parameters": {...}}` calls."""
    tools = {t.function.name: t.function.parameters or {"type": "object"} for t in body.tools or []}
    if isinstance(body.tool_choice, NamedToolChoice):
        return tools[body.tool_choice.function.name]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def check(kind: str, spec: str, param: str) -> None:
    """400 naming `param` when the constraint does not build (cheap: no tokenizer)."""
    try:
        StructuredSpec(kind, spec).validate(param)
    except ValueError as exc:  # its message starts with `param`
        raise APIError(400, str(exc), param=param) from None
