"""Validation and normalisation of OpenAI chat inputs (`messages`, `tools`, `tool_choice`,
`chat_template_kwargs`) into what Hugging Face chat templates expect.

Domain code: no grpc. Bad input raises `InvalidArgument` naming the offending field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.errors import InvalidArgument

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ImageRef:
    """An `image_url` content part: its URL and the request field it came from."""

    url: str
    field: str


@dataclass(frozen=True)
class ParsedMessages:
    """Messages ready for a chat template, plus the images they reference in order."""

    messages: list[dict[str, Any]]
    images: list[ImageRef]


def parse_json(text: str, field: str, default: Any) -> Any:
    """Parses a JSON request field; empty text gives `default`."""
    if not text.strip():
        return default
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{field} is not valid JSON: {exc}", param=field) from exc


def _fail(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {message}", param=field)


def _parse_part(part: Any, field: str, images: list[ImageRef]) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict):
        raise _fail(field, "content part must be an object")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise _fail(f"{field}.text", "must be a string")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str) or not url:
            raise _fail(f"{field}.image_url", "must be an object with a non-empty `url` string")
        images.append(ImageRef(url, f"{field}.image_url"))
        return {"type": "image"}
    raise _fail(f"{field}.type", f"unsupported content part type {kind!r} (expected text or image_url)")


def _parse_content(content: Any, field: str, images: list[ImageRef]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(field, "must be a string, a list of content parts or null")
    first_image = len(images)
    parts = [_parse_part(part, f"{field}[{j}]", images) for j, part in enumerate(content)]
    if len(images) == first_image:
        # Text only: the plain-string form every chat template understands.
        return "\n".join(p["text"] for p in parts)
    return parts


def _parse_arguments(arguments: Any, field: str) -> Any:
    """Tool-call arguments as a JSON object (OpenAI sends a JSON string; templates want a dict)."""
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
        return decoded if isinstance(decoded, dict) else arguments
    if isinstance(arguments, dict):
        return arguments
    raise _fail(field, "must be a JSON string or an object")


def _parse_tool_calls(tool_calls: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise _fail(field, "must be a list")
    parsed = []
    for k, call in enumerate(tool_calls):
        where = f"{field}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _fail(where, "must be an object with a `function` holding a `name` string")
        arguments = _parse_arguments(function.get("arguments", {}), f"{where}.function.arguments")
        parsed.append(
            {
                "id": call.get("id", ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return parsed


def _parse_message(message: Any, i: int, images: list[ImageRef]) -> dict[str, Any]:
    field = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _fail(field, "must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise _fail(f"{field}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": role}
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise _fail(f"{field}.tool_calls", "only assistant messages may have tool_calls")
        out["tool_calls"] = _parse_tool_calls(tool_calls, f"{field}.tool_calls")
    content = message.get("content")
    if content is None:
        if not out.get("tool_calls"):
            raise _fail(f"{field}.content", "is required (null only for assistant messages with tool_calls)")
        out["content"] = None
    else:
        out["content"] = _parse_content(content, f"{field}.content", images)
    for key in ("name", "tool_call_id"):
        if key in message and message[key] is not None:
            if not isinstance(message[key], str):
                raise _fail(f"{field}.{key}", "must be a string")
            out[key] = message[key]
    return out


def parse_messages(messages: Any) -> ParsedMessages:
    """Validates an OpenAI `messages` array and normalises it for a chat template.

    Text-only content lists become one string (parts joined by newlines); content with
    images stays a list of `{"type": "text"}` / `{"type": "image"}` parts, the Hugging Face
    multimodal convention. Tool-call arguments given as JSON strings become objects.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list", param="messages")
    images: list[ImageRef] = []
    parsed = [_parse_message(message, i, images) for i, message in enumerate(messages)]
    return ParsedMessages(parsed, images)


def _tool_names(tools: list[dict[str, Any]]) -> set[str]:
    return {tool["function"]["name"] for tool in tools}


def parse_tools(tools: Any) -> list[dict[str, Any]]:
    """Validates an OpenAI `tools` array (function tools with a name)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidArgument("tools must be a list", param="tools")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _fail(f"tools[{k}]", "must be an object with type 'function'")
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise _fail(f"tools[{k}].function.name", "must be a non-empty string")
    return tools


def apply_tool_choice(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools to show the template: none for `"none"`, all otherwise.

    A named choice (`{"type": "function", "function": {"name": ...}}`) must name one of
    the tools; `"required"` and named choices need tools.
    """
    if tool_choice is None or tool_choice == "auto":
        return tools or None
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        if not tools:
            raise InvalidArgument("tool_choice 'required' needs a non-empty tools list", param="tool_choice")
        return tools
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidArgument("tool_choice.function.name must be a string", param="tool_choice")
        if name not in _tool_names(tools):
            raise InvalidArgument(
                f"tool_choice names function {name!r}, which is not in tools", param="tool_choice"
            )
        return tools
    raise InvalidArgument(
        "tool_choice must be 'none', 'auto', 'required' or a named function", param="tool_choice"
    )


def parse_template_kwargs(kwargs: Any, reserved: frozenset[str]) -> dict[str, Any]:
    """Validates `chat_template_kwargs`: a JSON object of extra template variables whose
    names are identifiers not reserved by the renderer (`messages`, `tools`, ...)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidArgument("chat_template_kwargs must be a JSON object", param="chat_template_kwargs")
    for key in kwargs:
        if not key.isidentifier() or key.startswith("_"):
            raise InvalidArgument(
                f"chat_template_kwargs key {key!r} is not allowed", param="chat_template_kwargs"
            )
        if key in reserved:
            raise InvalidArgument(
                f"chat_template_kwargs may not set {key!r} (use the request field instead)",
                param="chat_template_kwargs",
            )
    return kwargs
