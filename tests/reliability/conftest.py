"""Fixtures: the session's shared real mesh (see tests/reliability/meshkit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.meshkit import SharedMesh, release_after_last_test, shared_mesh


@pytest.fixture(scope="session")
def shared(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> SharedMesh:
    """The real mesh shared by the reliability, security and fuzz suites (started once)."""
    return shared_mesh(request.config, tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def mesh(shared: SharedMesh) -> SharedMesh:
    """The shared mesh with every service running and healthy at the start of a module."""
    shared.ensure_running()
    return shared


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stops the shared mesh once the last test of the three suites has run."""
    release_after_last_test(item)
