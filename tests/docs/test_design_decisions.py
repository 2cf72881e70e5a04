"""Every "Reproduce:" command of docs/design-decisions.md names a module that exists: in
today's tree, or at the commit it checks out first; a bench module with a parser of its
own (`build_parser`) accepts the command's options."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "design-decisions.md"
# Placeholders the commands use for a path the reader supplies.
PLACEHOLDERS = {"MODEL": "/m", "TINY_LLAMA": "/m"}


def _reproduce_bullets() -> list[str]:
    """Each "- Reproduce:" bullet, its continuation lines joined."""
    bullets, current = [], None
    for line in DOC.read_text().splitlines():
        if line.startswith("- Reproduce:"):
            current = [line]
            bullets.append(current)
        elif current is not None and line.startswith("  ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return [" ".join(b) for b in bullets]


def _commands(bullet: str) -> list[tuple[str, list[str]]]:
    """(module, options) of each `python -m MODULE ...` in the bullet's code spans."""
    out = []
    for span in re.findall(r"`([^`]+)`", bullet):
        found = re.search(r"python -m ([\w.]+)(.*)", span)
        if found:
            options = re.sub(r"\[[^\]]*\]", "", found.group(2)).split()
            out.append((found.group(1), [PLACEHOLDERS.get(o, o) for o in options]))
    return out


BULLETS = _reproduce_bullets()


def test_the_doc_has_reproduce_commands() -> None:
    assert sum(len(_commands(b)) for b in BULLETS) >= 15


@pytest.mark.parametrize("bullet", BULLETS, ids=lambda b: b[13:60])
def test_each_reproduce_command_names_a_module_that_exists(bullet: str) -> None:
    checkout = re.search(r"git checkout (\w+)", bullet)
    for module, options in _commands(bullet):
        path = module.replace(".", "/") + ".py"
        if checkout:
            if not (ROOT / ".git").exists():
                pytest.skip("not a git checkout: the commit cannot be read")
            found = subprocess.run(
                ["git", "cat-file", "-e", f"{checkout.group(1)}:{path}"], cwd=ROOT, check=False
            )
            assert found.returncode == 0, f"{path} is not in commit {checkout.group(1)}"
            continue
        assert (ROOT / path).exists(), f"{module} (in {bullet[:60]!r}) is not in the tree"
        loaded = importlib.import_module(module)
        if hasattr(loaded, "build_parser"):
            loaded.build_parser().parse_args(options)
