"""Every service option is declared once with its help: `--help` shows that help with the
option's env variable and default, and a nested config's fields are options of their own."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from encoder_cache_svc.config import EncoderCacheConfig
from gateway.config import GatewayConfig
from scheduler_svc.config import SchedulerConfig
from services.config import build_parser, env_for, from_options, load_config, opt, options
from tokenizer_svc.config import TokenizerConfig
from worker_svc.config import WorkerConfig

SERVICE_CONFIGS = [GatewayConfig, SchedulerConfig, TokenizerConfig, EncoderCacheConfig, WorkerConfig]


def _flat(text: str) -> str:
    """`text` without whitespace (argparse wraps help lines, also at hyphens)."""
    return "".join(text.split())


@pytest.mark.parametrize("cls", SERVICE_CONFIGS, ids=lambda c: c.__name__)
def test_every_option_has_a_help_that_help_shows(cls: type[Any]) -> None:
    shown = _flat(build_parser(cls).format_help())
    for option in options(cls):
        assert len(option.help) > 8, f"{cls.__name__} {option.flag} has no real help"
        assert _flat(f"{option.flag} {option.name.upper()} {option.help} (env {option.env}") in shown


def test_the_worker_help_shows_the_engine_options(capsys: pytest.CaptureFixture[str]) -> None:
    """What `python -m worker_svc --help` prints (its `main` parses argv with `load_config`)."""
    with pytest.raises(SystemExit) as exited:
        load_config(WorkerConfig, ["--help"], prog="worker_svc")
    assert exited.value.code == 0
    shown = _flat(capsys.readouterr().out)
    assert _flat("engine options:") in shown
    assert (
        _flat(
            "the most sequences in one engine step (running at once) (env MESHSERVE_MAX_NUM_SEQS, default 64)"
        )
        in shown
    )
    assert "--kv-cache-memory-mb" in shown and "--engine-priority" in shown


@dataclasses.dataclass(frozen=True)
class Inner:
    size: int = opt(3, "an inner size")
    names: tuple[str, ...] = opt((), "inner names")


@dataclasses.dataclass(frozen=True)
class Outer:
    label: str = opt("x", "an outer label")
    inner: Inner = dataclasses.field(default_factory=Inner)


@dataclasses.dataclass(frozen=True)
class Clash:
    size: int = opt(1, "a size clashing with the inner one")
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_nested_fields_are_flat_options(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [o.name for o in options(Outer)] == ["label", "size", "names"]
    monkeypatch.setenv("MESHSERVE_NAMES", "a,b")
    config = load_config(Outer, ["--size", "5"])
    assert config == Outer(label="x", inner=Inner(size=5, names=("a", "b")))
    assert env_for(config) == {"MESHSERVE_LABEL": "x", "MESHSERVE_SIZE": "5", "MESHSERVE_NAMES": "a,b"}
    assert from_options(Outer, size=7) == Outer(inner=Inner(size=7))
    with pytest.raises(TypeError, match="nope"):
        from_options(Outer, nope=1)
    with pytest.raises(TypeError, match="size"):
        options(Clash)


SERVICE_CODE = ("gateway", "services", "scheduler_svc", "worker_svc", "tokenizer_svc", "encoder_cache_svc")


def test_no_service_reads_a_setting_around_its_config() -> None:
    """MESHSERVE_* variables reach a service through its config's options (help, --flag,
    validation) only: no service module reads one from the environment itself."""
    root = Path(__file__).resolve().parents[2]
    direct = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\()\s*["']MESHSERVE_""")
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for package in SERVICE_CODE
        for path in sorted((root / package).rglob("*.py"))
        if path.name != "config.py" or package != "services"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert not found, "settings read around the config system:\n" + "\n".join(found)
    assert direct.search('os.environ.get("MESHSERVE_UVLOOP", "1")')  # the pattern still matches
