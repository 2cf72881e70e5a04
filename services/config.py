"""Frozen-dataclass configuration loaded from CLI flags and environment variables.

Every service declares its own small frozen dataclass whose fields are declared with
`opt(default, help)`; `load_config` turns each field into a `--flag-name` option whose
default comes from the `MESHSERVE_FLAG_NAME` env var, then from the dataclass default.
Flags win over env, env wins over defaults. A field whose type is itself a config
dataclass (the worker's `engine: EngineConfig`) contributes its fields as options of
their own, under their own names: each knob is declared once, where it is used.
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

# The port each component listens on by default: the services' `port` fields, the local
# launcher and the Helm chart (tests/deploy checks values.yaml against this table).
DEFAULT_PORTS = {
    "gateway": 8000,
    "tokenizer": 50051,
    "scheduler": 50052,
    "encoder-cache": 50070,
    "decoder": 50061,
    "embedding": 50081,
    "encoder": 50091,
    "prefill": 50101,
}


def opt(default: T, help: str) -> T:
    """A config field: its default and the help `--help` shows, declared together once."""
    return dataclasses.field(default=default, metadata={"help": help})


def required(help: str) -> Any:
    """A config field without a default (construction fails without it)."""
    return dataclasses.field(metadata={"help": help})


def same_as(cls: type[Any], name: str, help: str = "") -> Any:
    """A field taking the default (and, unless `help` is given, the help) of option `name`
    of config `cls`: a knob another config passes on keeps a single declaration."""
    source = _option(cls, name)
    return opt(source.default, help or source.help)


def default_of(cls: type[Any], name: str) -> Any:
    """The default of option `name` of config `cls` (nested configs included)."""
    return _option(cls, name).default


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option: a field of the config or of a config nested in it."""

    path: tuple[str, ...]  # attributes from the top config: ("engine", "max_num_seqs")
    field: dataclasses.Field[Any]
    type: Any

    @property
    def name(self) -> str:
        """The option's name: its field's name (`max_num_seqs`)."""
        return self.path[-1]

    @property
    def flag(self) -> str:
        """`--max-num-seqs`."""
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """`MESHSERVE_MAX_NUM_SEQS`."""
        return ENV_PREFIX + self.name.upper()

    @property
    def help(self) -> str:
        """What `opt` declared as the option's help ("" if nothing)."""
        return str(self.field.metadata.get("help", ""))

    @property
    def default(self) -> Any:
        """The field's default (None for a required field)."""
        return _cli_default(self.field)

    def parse(self, text: str) -> Any:
        """The value an env variable or flag spelling `text` gives this option."""
        return _converter(self.type)(text)


def options(cls: type[Any]) -> list[Option]:
    """Every option of config `cls`: its fields, a nested config's fields in its place.
    TypeError when two of them would share a name."""
    hints = typing.get_type_hints(cls)
    found: list[Option] = []
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        if _is_config(tp):
            found += [dataclasses.replace(o, path=(field.name, *o.path)) for o in options(tp)]
        else:
            found.append(Option((field.name,), field, tp))
    names = [o.name for o in found]
    if len(names) != len(set(names)):
        raise TypeError(f"{cls.__name__}: options {sorted({n for n in names if names.count(n) > 1})} twice")
    return found


def env_names(cls: type[Any]) -> set[str]:
    """The MESHSERVE_* variables config `cls` reads."""
    return {o.env for o in options(cls)}


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _option(cls: type[Any], name: str) -> Option:
    found = [o for o in options(cls) if o.name == name]
    if not found:
        raise TypeError(f"{cls.__name__} has no option {name!r}")
    return found[0]


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
    """An argparse parser with one `--option-name` per option of config `cls`: its help,
    then its env variable and default."""
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    groups: dict[tuple[str, ...], Any] = {(): parser}
    for option in options(cls):
        convert = _converter(option.type)
        env = os.environ.get(option.env)
        default = convert(env) if env is not None else option.default
        nest = option.path[:-1]
        if nest not in groups:  # a nested config's options under its field's name
            groups[nest] = parser.add_argument_group(f"{'.'.join(nest)} options")
        groups[nest].add_argument(
            option.flag,
            dest=option.name,
            type=convert,
            default=default,
            help=f"{option.help} (env {option.env}, default {default!r})".lstrip(),
        )
    return parser


def from_options(cls: type[T], **values: Any) -> T:
    """Config `cls` from option values by option name (a nested config's options flat,
    as on the command line); an option not given takes its default. TypeError names an
    option `cls` does not have."""
    unknown = sorted(set(values) - {o.name for o in options(cls)})
    if unknown:
        raise TypeError(f"{cls.__name__} has no option(s) {unknown}")
    return _build(cls, values)


def _build(cls: type[T], values: dict[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(typing.cast(Any, cls)):
        if _is_config(hints[field.name]):
            kwargs[field.name] = _build(hints[field.name], values)
        elif field.name in values:
            kwargs[field.name] = values[field.name]
    return cls(**kwargs)


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
        return _build(cls, vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")  # parser.error exits


def _value(config: Any, option: Option) -> Any:
    """`option`'s value in `config` (following the path into a nested config)."""
    value = config
    for attribute in option.path:
        value = getattr(value, attribute)
    return value


def env_for(config: Any) -> dict[str, str]:
    """The MESHSERVE_* environment that reproduces `config` in a child process."""
    env: dict[str, str] = {}
    for option in options(type(config)):
        value = _value(config, option)
        if value is None:
            continue
        if isinstance(value, bool):
            env[option.env] = "true" if value else "false"
        elif isinstance(value, tuple):
            env[option.env] = ",".join(str(v) for v in value)
        else:
            env[option.env] = str(value)
    return env


def at_least(config: object, minimum: float, *names: str) -> None:
    """Raises ValueError ("a and b must be >= 0") when a field `names` of `config` is
    below `minimum`: the range check every config's `__post_init__` makes."""
    if any(getattr(config, name) < minimum for name in names):
        raise ValueError(f"{_listed(names)} must be >= {minimum}")


def positive(config: object, *names: str) -> None:
    """Raises ValueError ("a and b must be > 0") when a field `names` of `config` is not
    above 0."""
    if any(getattr(config, name) <= 0 for name in names):
        raise ValueError(f"{_listed(names)} must be > 0")


def _listed(names: Sequence[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))


# The largest gRPC message any service sends or accepts (images, embeddings, KV chunks).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
TRACING_MODES = ("none", "console", "otlp", "memory")


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """Options every service process shares: where it listens, how it logs, traces and
    drains, its TLS files and its event loop."""

    host: str = opt("127.0.0.1", "the address to listen on")
    port: int = opt(0, "the port to listen on (0: any free port)")
    drain_timeout_s: float = opt(
        30.0, "on SIGTERM, new requests are refused and those in flight get this long to finish"
    )
    log_level: str = opt("INFO", "Python logging level")
    tracing: str = opt("none", f"OpenTelemetry tracing: {', '.join(TRACING_MODES)}")
    otlp_endpoint: str = opt("", "the OTLP/gRPC collector of --tracing otlp (e.g. http://collector:4317)")
    tls_cert: str = opt(
        "",
        "PEM certificate of this process: a server's TLS certificate, a client's in mutual TLS (services/tls.py)",
    )
    tls_key: str = opt("", "PEM private key of --tls-cert")
    tls_ca: str = opt(
        "",
        "PEM CA bundle: this process's clients verify servers against it (TLS on); a server with it "
        "requires client certificates (mutual TLS)",
    )
    uvloop: bool = opt(True, "run the event loop on uvloop when it is installed (else asyncio's own)")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        at_least(self, 0, "drain_timeout_s")
        if self.tracing not in TRACING_MODES:
            raise ValueError(f"tracing must be one of {', '.join(TRACING_MODES)}")


@dataclasses.dataclass(frozen=True)
class ServerConfig(ProcessConfig):
    """Options every gRPC service shares: its process options, metrics, message size."""

    metrics_port: int = opt(0, "Prometheus /metrics port (0: no metrics endpoint)")
    max_message_bytes: int = opt(MAX_MESSAGE_BYTES, "the largest gRPC message sent or accepted")

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_message_bytes")
