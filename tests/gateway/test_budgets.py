"""Tenant budgets (gateway/budgets.py): tokens and requests per minute, reserved before
any work is queued and settled at the end; one budget across gateway replicas through a
real redis-server, each replica's own without it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import anthropic
import openai
import pytest
from gateway_fakes import MODEL, Harness, RunningGateway

from gateway.budgets import Budget, TenantBudgets, parse_key_budgets
from gateway.config import GatewayConfig
from gateway.errors import APIError
from services.ports import free_port
from services.redis_client import RedisServer

MESSAGES = [{"role": "user", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _budgets(backend: str, redis: RedisServer, budget: Budget, clock: Clock | None = None) -> TenantBudgets:
    url = redis.url if backend == "redis" else ""
    return TenantBudgets(budget, {}, url, clock or Clock())


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[RedisServer]:
    """The session's redis-server, its budget keys removed after each test."""
    yield redis_server

    async def flush() -> None:
        from services import redis_client

        client = redis_client.connect(redis_server.url)
        keys = await client.keys("meshserve:budget:*")
        if keys:
            await client.delete(*keys)
        await client.aclose()

    asyncio.run(flush())


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_tokens_reserved_refused_and_given_back(backend: str, redis: RedisServer) -> None:
    async def run() -> None:
        budgets = _budgets(backend, redis, Budget(tokens=100))
        first = await budgets.reserve("t", 60)
        with pytest.raises(APIError) as refused:
            await budgets.reserve("t", 60)  # 40 left: 20 more take 12 s at 100 per minute
        assert refused.value.status == 429 and refused.value.code == "budget_exceeded"
        assert 11 <= int(refused.value.headers["Retry-After"]) <= 13
        assert first is not None
        await budgets.settle(first, 10)  # 50 unused come back: 90 left
        await budgets.settle(first, 10)  # once only
        assert await budgets.reserve("t", 60) is not None
        with pytest.raises(APIError):
            await budgets.reserve("t", 60)
        assert await budgets.reserve("other", 60) is not None  # buckets are per tenant
        with pytest.raises(APIError) as never:
            await budgets.reserve("fresh", 101)  # more than a minute's allowance
        assert never.value.code == "token_budget_exceeded" and never.value.param == "max_tokens"
        await budgets.close()

    asyncio.run(run())


def test_local_bucket_refills_at_the_allowance_rate() -> None:
    async def run() -> None:
        clock = Clock()
        budgets = TenantBudgets(Budget(tokens=60, requests=2), {}, "", clock)
        await budgets.reserve("t", 60)
        with pytest.raises(APIError):
            await budgets.reserve("t", 1)
        clock.now += 1.0  # 1 token per second
        assert await budgets.reserve("t", 1) is not None
        with pytest.raises(APIError) as requests:
            await budgets.reserve("t", 0)  # the third request within the minute
        assert int(requests.value.headers["Retry-After"]) == 29  # 2 per minute, 1 s refilled: 29 s left
        assert await TenantBudgets(Budget(), {}, "").reserve("t", 10**9) is None  # no budget

    asyncio.run(run())


@pytest.mark.parametrize("shared", [True, False])
def test_replicas_share_one_budget_through_redis(shared: bool, redis: RedisServer) -> None:
    """Two replicas, 2 requests per minute: with Redis the third request is refused
    whichever replica gets it; each replica counting alone would admit it."""

    async def run() -> None:
        a, b = (_budgets("redis" if shared else "local", redis, Budget(requests=2)) for _ in range(2))
        await a.reserve("t", 5)
        await b.reserve("t", 5)
        if shared:
            with pytest.raises(APIError):
                await a.reserve("t", 5)
        else:
            assert await a.reserve("t", 5) is not None
        await a.close()
        await b.close()

    asyncio.run(run())


def test_redis_down_counts_in_process(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        budgets = TenantBudgets(Budget(requests=1), {}, f"redis://127.0.0.1:{free_port()}/0")
        assert await budgets.reserve("t", 1) is not None  # admitted, not failed
        with pytest.raises(APIError):
            await budgets.reserve("t", 1)  # the process's own bucket meanwhile
        await budgets.close()

    asyncio.run(run())
    assert "redis failed" in caplog.text


def test_bad_budget_config_names_the_field() -> None:
    assert parse_key_budgets(("k1=1000/10",), ("k1",)) == {"k1": Budget(1000, 10)}
    for entries in (("k1=1000",), ("k1=-5/1",), ("k1=x/1",), ("1000/10",)):
        with pytest.raises(ValueError, match="key_budgets"):
            parse_key_budgets(entries, ("k1",))
    with pytest.raises(ValueError, match="key_budgets: a key that is not one of api_keys"):
        GatewayConfig(api_keys=("k1",), key_budgets=("k2=10/1",))
    with pytest.raises(ValueError, match="tokens_per_minute_per_key"):
        GatewayConfig(tokens_per_minute_per_key=-1)


def _gateways(harness: Harness, redis: RedisServer, **budget: object) -> list[RunningGateway]:
    config = harness.config(api_keys=("k1", "k2"), redis_url=redis.url, **budget)
    return [harness.start_gateway(config) for _ in range(2)]


def test_gateways_refuse_over_budget_with_each_sdks_error(harness: Harness, redis: RedisServer) -> None:
    """2 requests per minute for k1 across two replicas sharing Redis: the third, on
    either replica, is a 429 (OpenAI's error to the openai SDK, Anthropic's to the
    anthropic SDK) with Retry-After; k2 has its own budget."""
    gws = _gateways(harness, redis, requests_per_minute_per_key=2, key_budgets=("k2=0/5",))
    try:
        one, two = (openai.OpenAI(base_url=g.url + "/v1", api_key="k1", max_retries=0) for g in gws)
        one.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
        two.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
        with pytest.raises(openai.RateLimitError) as refused:
            one.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.code == "budget_exceeded"
        claude = anthropic.Anthropic(base_url=gws[1].url, api_key="k1", max_retries=0)
        with pytest.raises(anthropic.RateLimitError):
            claude.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES)  # type: ignore[arg-type]
        k2 = openai.OpenAI(base_url=gws[1].url + "/v1", api_key="k2", max_retries=0)
        for _ in range(3):
            k2.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert harness.worker.last_request is not None
    finally:
        for g in gws:
            harness.stop_gateway(g)


def test_gateway_refuses_a_request_above_the_token_budget(harness: Harness, redis: RedisServer) -> None:
    gws = _gateways(harness, redis, tokens_per_minute_per_key=50)
    try:
        client = openai.OpenAI(base_url=gws[0].url + "/v1", api_key="k1", max_retries=0)
        before = len(harness.scheduler.requests)
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60)  # type: ignore[arg-type]
        assert refused.value.code == "token_budget_exceeded" and refused.value.param == "max_tokens"
        assert len(harness.scheduler.requests) == before  # refused before anything was queued
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
    finally:
        for g in gws:
            harness.stop_gateway(g)
