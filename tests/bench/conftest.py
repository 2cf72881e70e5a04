"""Fixtures for the `bench.serve` tests: the fake OpenAI server of `fake_openai.py`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_openai import FakeOpenAI, start_fake


@pytest.fixture(scope="module")
def fake_openai() -> Iterator[FakeOpenAI]:
    """The fake server on a free loopback port, for the whole module."""
    state, server, thread = start_fake()
    yield state
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def fake(fake_openai: FakeOpenAI) -> FakeOpenAI:
    """The shared fake server with its recorded traffic cleared."""
    fake_openai.reset()
    return fake_openai
