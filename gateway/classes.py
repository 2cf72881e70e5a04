"""Priority classes: what a request's class makes of its priority and its queue timeout.

A class is ``NAME=PRIORITY[/QUEUE_TIMEOUT_S]`` (``--classes``): PRIORITY in vLLM's sense
(lower runs first; the mesh negates it), QUEUE_TIMEOUT_S the longest the request may wait
in the scheduler's admission queue (absent: the scheduler's ``--queue-timeout-s``; 0: it
never waits: refused with 429 at once when no worker can take it, which is what makes a
class sheddable). A request names its class in ``service_tier``, the field the openai and
anthropic SDKs already send; their own tier names are aliases (``ALIASES``), and ``auto``
(or no field) is its key's class (``--key-classes KEY=CLASS``), else ``default``.

A key's class is also its ceiling: a request may ask for a class, or a ``priority``, that
runs later than its key's, never one that runs sooner (400 naming the field). A request's
own ``priority`` (vLLM's extension) orders it within its class' place only when it asks
for no class, as before classes existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.errors import APIError

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

__all__ = [
    "ALIASES",
    "DEFAULT",
    "Classes",
    "PriorityClass",
    "Resolved",
    "parse_classes",
    "parse_key_classes",
    "priority_classes",
]

DEFAULT = "default"
# The SDKs' tier names: OpenAI's service_tier (auto, default, flex, scale, priority) and
# Anthropic's (auto, standard_only), as the class each stands for here.
ALIASES = {"priority": "interactive", "flex": "batch", "scale": DEFAULT, "standard_only": DEFAULT}


@dataclass(frozen=True)
class PriorityClass:
    """One class: its name, vLLM priority (lower first) and queue timeout (None: the
    scheduler's; 0: never queued)."""

    name: str
    priority: int
    queue_timeout_s: float | None = None


def parse_classes(entries: tuple[str, ...]) -> dict[str, PriorityClass]:
    """``("NAME=PRIORITY[/QUEUE_TIMEOUT_S]", ...)`` -> {name: class}; ValueError naming
    ``classes`` for a malformed entry, a negative timeout, or no ``default`` class."""
    out: dict[str, PriorityClass] = {}
    for entry in entries:
        name, sep, rest = entry.partition("=")
        priority, slash, timeout = rest.partition("/")
        try:
            value = int(priority)
            queue_timeout = float(timeout) if slash else None
        except ValueError:
            value, queue_timeout = None, None
        if not (sep and name.isidentifier() and value is not None) or (slash and queue_timeout is None):
            raise ValueError(f"classes: {entry!r} is not 'NAME=PRIORITY[/QUEUE_TIMEOUT_S]'")
        if queue_timeout is not None and not 0 <= queue_timeout < float("inf"):
            raise ValueError(f"classes: {entry!r}: the queue timeout must be >= 0 seconds")
        if name in out or name in ALIASES or name == "auto":
            raise ValueError(f"classes: {name!r} is declared twice or is a reserved tier name")
        out[name] = PriorityClass(name, value, queue_timeout)
    if DEFAULT not in out:
        raise ValueError(f"classes: no {DEFAULT!r} class (the class of requests that name none)")
    return out


def parse_key_classes(
    entries: tuple[str, ...], keys: tuple[str, ...], classes: dict[str, PriorityClass]
) -> dict[str, str]:
    """``("KEY=CLASS", ...)`` -> {key: class name}; ValueError naming ``key_classes`` for a
    malformed entry, a key not among ``keys`` or a class not among ``classes``."""
    out: dict[str, str] = {}
    for entry in entries:
        key, sep, name = entry.rpartition("=")
        if not sep:
            raise ValueError(f"key_classes: {entry!r} is not 'KEY=CLASS'")
        if key not in keys:
            raise ValueError("key_classes: a key that is not one of api_keys or admin_api_keys")
        if name not in classes:
            raise ValueError(f"key_classes: unknown class {name!r} (classes: {', '.join(classes)})")
        out[key] = name
    return out


@dataclass(frozen=True)
class Resolved:
    """A request's class and what it runs with: mesh priority (higher first) and queue timeout."""

    name: str
    priority: int
    queue_timeout_s: float | None


class Classes:
    """The configured classes and each tenant's (module docstring)."""

    def __init__(self, classes: dict[str, PriorityClass], tenant_classes: dict[str, str]) -> None:
        self.classes = classes
        self.tenant_classes = tenant_classes

    def resolve(self, tenant: str, service_tier: str | None, priority: int) -> Resolved:
        """The class of a request of ``tenant`` asking for ``service_tier`` with vLLM
        ``priority``; APIError 400 naming the field for an unknown class or one above the
        tenant's."""
        own = self.classes[self.tenant_classes.get(tenant, DEFAULT)]
        tier = ALIASES.get(service_tier or "auto", service_tier or "auto")
        if tier == "auto":
            chosen = own
        elif tier in self.classes:
            chosen = self.classes[tier]
        else:
            raise APIError(
                400,
                f"unknown service_tier {service_tier!r} (classes: {', '.join(self.classes)}, or auto)",
                param="service_tier",
            )
        ceiling = own.priority if tenant in self.tenant_classes else None
        if ceiling is not None and chosen.priority < ceiling:
            raise APIError(
                400,
                f"service_tier {service_tier!r} runs before this key's class {own.name!r}",
                param="service_tier",
            )
        value = priority if (priority and tier == "auto") else chosen.priority
        if ceiling is not None and value < ceiling:
            raise APIError(
                400, f"priority {priority} runs before this key's class {own.name!r}", param="priority"
            )
        return Resolved(chosen.name, -value, chosen.queue_timeout_s)


def priority_classes(config: GatewayConfig) -> Classes:
    """The classes ``config`` declares, each key's class under its tenant id."""
    from gateway.middleware import tenant_of

    classes = parse_classes(config.classes)
    keys = parse_key_classes(config.key_classes, config.api_keys + config.admin_api_keys, classes)
    return Classes(classes, {tenant_of(k): name for k, name in keys.items()})
