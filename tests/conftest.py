"""Fixtures shared by every test package: model directories, a real Redis and the session's
shared mesh (tests/mesh.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.redis_client import RedisServer
from tests import head_start
from tests.mesh import RunningMesh, release_after_last_test, session_mesh, start_e2e_mesh, start_shared_mesh
from tests.models import build_test_model, default_model

# The services the tests start compute in float32 whatever the host: the tests compare their tokens
# with float32 references (transformers' generate, an in-process engine, an earlier answer), and
# bfloat16 results depend on batch composition. The worker's default, dtype auto, is bf16 on hosts
# with native bf16; tests/worker_engine/test_bf16_parity.py and the default model's answers
# (tests/e2e/test_default_model_answers.py, the worker's defaults exactly) cover that path.
os.environ.setdefault("MESHSERVE_DTYPE", "float32")
# ...and eagerly: a compiled forward costs each worker a minute or more of warm-up before ready. The
# compiled path has tests of its own (compile_model=True), and the default model's end-to-end
# tests run the mesh with the worker's defaults (tests/e2e/test_default_model_answers.py).
os.environ.setdefault("MESHSERVE_COMPILE_MODEL", "false")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama with a trained tokenizer and ChatML template, built in seconds: the model
    of every test not about what a real model answers (`MESHSERVE_TEST_MODEL_DIR` overrides it)."""
    configured = os.environ.get("MESHSERVE_TEST_MODEL_DIR")
    if configured:
        return Path(configured)
    return build_test_model(tmp_path_factory.mktemp("models") / "test-llama")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model, SmolLM2-135M-Instruct (`make model` builds it; built here if missing)."""
    return default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A very small untrained model for fast tests (same loading code as any HF dir)."""
    return build_test_model(tmp_path_factory.mktemp("models") / "tiny", "--tiny")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port for the whole session."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def shared(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> RunningMesh:
    """The real mesh the reliability, security and fuzz suites share (tests/mesh.py)."""
    return session_mesh(request, start_shared_mesh(tiny_model_dir, tmp_path_factory.mktemp("shared-mesh")))


@pytest.fixture(scope="session")
def e2e_mesh(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> RunningMesh:
    """The test model's one-decoder mesh the e2e suites share (tests/mesh.py)."""
    return session_mesh(request, start_e2e_mesh(model_dir, tmp_path_factory.mktemp("e2e-mesh")))


@pytest.fixture(scope="module")
def mesh(shared: RunningMesh) -> RunningMesh:
    """The mesh a test runs on: the shared one, with every service running and healthy at
    the start of a module (a module that starts its own mesh overrides this fixture)."""
    shared.ensure_running()
    return shared


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stops a session mesh once the last test that uses it has run."""
    release_after_last_test(item)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Starts the set-ups that run beside the other tests (tests/head_start.py)."""
    head_start.start(config, items)
