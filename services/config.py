"""Frozen-dataclass configuration loaded from CLI flags and environment variables.

Every service declares its own small frozen dataclass; `load_config` turns its fields
into `--flag-name` options whose defaults come from `MESHSERVE_FLAG_NAME` env vars,
then from the dataclass default. Flags win over env, env wins over defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "MESHSERVE_"


def _env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _base_type(tp: Any) -> Any:
    """Strips `X | None` to `X` so flags parse into the right scalar type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_tuple(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _converter(tp: Any) -> Any:
    base = _base_type(tp)
    if base is bool:
        return _parse_bool
    if base in (int, float, str):
        return base
    if typing.get_origin(base) is tuple or base is tuple:
        return _parse_tuple
    return str


def _cli_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def build_parser(cls: type[Any], prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one `--field-name` option per dataclass field."""
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        convert = _converter(tp)
        env = os.environ.get(_env_name(field.name))
        default = convert(env) if env is not None else _cli_default(field)
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=convert,
            default=default,
            help=f"(env {_env_name(field.name)}, default {default!r})",
        )
    return parser


def load_config(cls: type[T], argv: Sequence[str] | None = None, prog: str | None = None) -> T:
    """Builds `cls` from CLI `argv` (None = no flags) and MESHSERVE_* env vars.

    Invalid values raise `SystemExit` with argparse's message naming the flag, or the
    dataclass's own `ValueError` from `__post_init__`.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    parser = build_parser(cls, prog)
    namespace = parser.parse_args(list(argv) if argv is not None else [])
    try:
        return cls(**vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")  # parser.error exits


def env_for(config: Any) -> dict[str, str]:
    """The MESHSERVE_* environment that reproduces `config` in a child process."""
    env: dict[str, str] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None:
            continue
        if isinstance(value, bool):
            env[_env_name(field.name)] = "true" if value else "false"
        elif isinstance(value, tuple):
            env[_env_name(field.name)] = ",".join(str(v) for v in value)
        else:
            env[_env_name(field.name)] = str(value)
    return env


# The largest gRPC message any service sends or accepts (images, embeddings, KV chunks).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Options every gRPC service shares: where it listens and how it drains."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    drain_timeout_s: float = 30.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    log_level: str = "INFO"
    tracing: str = "none"
    otlp_endpoint: str = ""
    # Optional TLS / mutual TLS between services (see services/tls.py).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be > 0")
        if self.tracing not in ("none", "console", "otlp", "memory"):
            raise ValueError("tracing must be one of none, console, otlp, memory")
