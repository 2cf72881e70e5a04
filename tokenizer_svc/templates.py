"""Chat template safety: static checks on request-supplied Jinja templates.

Transformers renders every chat template in jinja2's `ImmutableSandboxedEnvironment`
(transformers/utils/chat_template_utils.py), which refuses access to private attributes
(`__class__`, `__globals__`, ...) at render time with `SecurityError`. This module adds a
static check so that a template that even mentions Python internals is refused up front
with a clear message, rather than rendering `''.__class__` as an empty string.
"""

from __future__ import annotations

import re

from jinja2 import TemplateSyntaxError, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.errors import InvalidArgument


class _GenerationTag(Extension):
    """Parses transformers' `{% generation %}...{% endgeneration %}` tag (body kept as is)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_DUNDER = re.compile(r"^__\w+__$")
_ENV = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols", _GenerationTag])


def _private_name(node: nodes.Node) -> str | None:
    if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
        return node.attr
    if isinstance(node, nodes.Getitem):
        arg = node.arg
        if isinstance(arg, nodes.Const) and isinstance(arg.value, str) and arg.value.startswith("_"):
            return arg.value
    if isinstance(node, nodes.Name) and node.name.startswith("__"):
        return node.name
    if isinstance(node, nodes.Const) and isinstance(node.value, str) and _DUNDER.match(node.value):
        return node.value  # e.g. `x | attr('__class__')`
    if (
        isinstance(node, nodes.Filter)
        and node.name == "attr"
        and not all(isinstance(a, nodes.Const) for a in node.args)
    ):
        # A name built at render time (`attr('_' ~ '_class__')`) cannot be checked here, and
        # the sandbox answers an unsafe one with an empty Undefined rather than an error.
        return "attr(<computed name>)"
    return None


def check_template(source: str, field: str = "chat_template") -> None:
    """Raises InvalidArgument naming `field` when `source` is not valid Jinja or touches
    private/dunder attributes (a sandbox escape attempt)."""
    try:
        tree = _ENV.parse(source)
    except TemplateSyntaxError as exc:
        raise InvalidArgument(f"{field} is not a valid Jinja template: {exc.message}", param=field) from exc
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Name, nodes.Const, nodes.Filter)):
        name = _private_name(node)
        if name is not None:
            raise InvalidArgument(
                f"{field} accesses the private attribute {name!r}; templates may not reach Python internals",
                param=field,
            )
