"""The layering of the tree, read from the imports of its sources: `services/` is the
ground floor every service imports and imports none of them; a service imports
`services` and the stubs, never another service; only the launcher, the benches and the
tests sit above the services. And no two of them define a class of the same name."""

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


def _class_homes(root: Path) -> dict[str, set[str]]:
    """Each public class name of the services and their shared ground: the packages defining it."""
    homes: dict[str, set[str]] = {}
    for package in (*SERVICES, "services", "launcher"):
        for path in (root / package).rglob("*.py"):
            for node in ast.parse(path.read_text(), str(path)).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    homes.setdefault(node.name, set()).add(package)
    return homes


def test_no_two_services_name_a_class_alike() -> None:
    """One name, one thing: the engine's step scheduler is not the mesh's Scheduler, the
    gateway's lease grant not the registry's Lease."""
    assert {name: homes for name, homes in _class_homes(ROOT).items() if len(homes) > 1} == {}


def test_the_name_check_sees_a_second_home(tmp_path: Path) -> None:
    for package in (*SERVICES, "services", "launcher"):
        (tmp_path / package).mkdir()
    (tmp_path / "gateway" / "a.py").write_text("class Lease:\n    pass\n")
    (tmp_path / "scheduler_svc" / "b.py").write_text("class Lease:\n    pass\n")
    assert _class_homes(tmp_path)["Lease"] == {"gateway", "scheduler_svc"}
