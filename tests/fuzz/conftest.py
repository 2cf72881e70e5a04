"""Fixtures: the session's shared real mesh (defined in tests/reliability/meshkit.py)."""

from tests.reliability.meshkit import mesh, pytest_runtest_teardown, shared

__all__ = ["mesh", "pytest_runtest_teardown", "shared"]
