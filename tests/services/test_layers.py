"""The layering of the tree, read from the imports of its sources: `services/` is the
ground floor every service imports and imports none of them; a service imports
`services` and the stubs, never another service; only the launcher, the benches and the
tests sit above the services."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "tokenizer_svc", "scheduler_svc", "worker_svc", "encoder_cache_svc")
ABOVE = ("launcher", "bench", "tests", "devtools", "deploy")


def _imported_packages(package: str, root: Path) -> dict[str, set[str]]:
    """For every source file of `package`: the top-level packages it imports (absolute)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(root))] = names
    return found


def _offending(package: str, forbidden: set[str], root: Path = ROOT) -> dict[str, set[str]]:
    imported = _imported_packages(package, root)
    return {f: names & forbidden for f, names in imported.items() if names & forbidden}


def test_services_imports_no_service_and_nothing_above_them() -> None:
    assert _offending("services", {*SERVICES, *ABOVE}) == {}


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service_and_nothing_above_it(service: str) -> None:
    assert _offending(service, ({*SERVICES} - {service}) | {*ABOVE}) == {}


def test_the_check_sees_an_import_that_runs_back_up(tmp_path: Path) -> None:
    """The rule's own check: a file of `services` importing a worker config is found."""
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "bad.py").write_text("from worker_svc.config import WorkerConfig\nimport os\n")
    assert _offending("services", {*SERVICES, *ABOVE}, tmp_path) == {"services/bad.py": {"worker_svc"}}
