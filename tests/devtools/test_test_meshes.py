"""Every mesh the suite starts goes through the one test mesh helper, tests/mesh.py: no
other test module builds a launcher config on free ports or a launcher `Mesh` (the
launcher's own tests aside, which test that machinery itself)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELPER = "tests/mesh.py"
MESH_STARTERS = {"free_ports_config", "Mesh", "RunningMesh"}


def _mesh_starts(tests: Path) -> dict[str, list[int]]:
    """Test modules (outside the helper and the launcher's own tests) calling a mesh
    starter, with the lines of the calls."""
    found: dict[str, list[int]] = {}
    for path in sorted(tests.rglob("*.py")):
        name = path.relative_to(tests.parent).as_posix()
        if name == HELPER or path.name.startswith("test_launcher_"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = (
                    node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                )
                if called in MESH_STARTERS:
                    found.setdefault(name, []).append(node.lineno)
    return found


def test_every_test_mesh_starts_through_the_helper() -> None:
    assert _mesh_starts(ROOT / "tests") == {}


def test_the_check_sees_a_module_starting_its_own_mesh(tmp_path: Path) -> None:
    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    (tmp_path / "tests" / "mesh.py").write_text("config = free_ports_config()\n")
    (tmp_path / "tests" / "e2e" / "test_x.py").write_text(
        "from launcher import mesh\n\nstarted = mesh.Mesh(free_ports_config()).start()\n"
    )
    assert _mesh_starts(tmp_path / "tests") == {"tests/e2e/test_x.py": [3, 3]}
