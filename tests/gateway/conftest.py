"""Fixtures: fake upstream services and gateways running in a background loop."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from gateway_fakes import Harness, RunningGateway


@pytest.fixture(scope="session")
def harness() -> Iterator[Harness]:
    """Fake tokenizer + scheduler (and the gateways started on them)."""
    h = Harness()
    yield h
    h.close()


@pytest.fixture(scope="session")
def gw(harness: Harness) -> RunningGateway:
    """A gateway with default config (no auth, no rate limit)."""
    return harness.start_gateway(harness.config())


@pytest.fixture(scope="session")
def client(gw: RunningGateway) -> Iterator[openai.OpenAI]:
    """The official OpenAI client pointed at `gw`."""
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
    yield c
    c.close()


@pytest.fixture(scope="session")
def http(gw: RunningGateway) -> Iterator[httpx.Client]:
    """Raw HTTP client for `gw`."""
    with httpx.Client(base_url=gw.url, timeout=20) as c:
        yield c


@pytest.fixture(scope="session")
def gw_url(gw: RunningGateway) -> str:
    """Base URL of `gw`."""
    return gw.url
