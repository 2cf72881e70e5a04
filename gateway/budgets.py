"""Per-tenant budgets per minute: tokens and requests, shared by every gateway replica.

A request reserves, before any work is queued, its prompt tokens plus ``n × max_tokens``
for each prompt, and one request; when it ends, the tokens it did not use are given back
(``settle``). Each budget is a bucket holding at most one minute's allowance that refills
continuously (``allowance / 60`` per second), so a tenant may burst up to a minute's worth
and then runs at the allowance's rate. A reservation the bucket cannot cover now is
refused with HTTP 429 and a ``Retry-After`` of when it could be; one larger than a whole
minute's allowance is refused naming ``max_tokens``.

With ``--redis-url`` the buckets live in Redis (``meshserve:budget:<tenant>``, one hash,
updated by one Lua script with Redis's own clock), so two replicas enforce one budget, not
two. Without Redis, or while Redis is unreachable, each replica keeps its own buckets (the
start-up log says so; an outage is logged): requests are never refused because the store
is down (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from gateway import metrics
from gateway.errors import APIError
from gateway.ratelimit import RateLimiter
from services import redis_client
from services.clock import Clock

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

__all__ = ["Budget", "Reservation", "TenantBudgets", "parse_key_budgets", "tenant_budgets"]

log = logging.getLogger(__name__)

_PREFIX = redis_client.KEY_PREFIX + "budget:"
_BUCKETS = {1: "tokens", 2: "requests"}
_MAX_LOCAL = 100_000  # tenants kept per process (cleared past it, as the rate limiter does)

# KEYS[1]: the tenant's hash. ARGV: token allowance, request allowance (per minute; 0: none),
# tokens, requests (negative: given back). Returns "<wait> <bucket>": wait 0 when taken (or
# given back), else the seconds until the buckets could cover them, -1 when they never
# could (above a minute's); bucket 1 (tokens) or 2 (requests), the one that refused.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local want = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local saved = redis.call('HMGET', KEYS[1], 'tokens', 'requests', 'at')
local at = tonumber(saved[3]) or now
local level, wait, which = {}, 0, 0
for i = 1, 2 do
  local cap = caps[i]
  level[i] = math.min(cap, (tonumber(saved[i]) or cap) + math.max(0, now - at) * cap / 60)
  if cap > 0 and want[i] > 0 then
    if want[i] > cap then return '-1 ' .. i end
    local need = (want[i] - level[i]) * 60 / cap
    if need > wait then wait, which = need, i end
  end
end
if wait == 0 then
  for i = 1, 2 do level[i] = math.min(caps[i], level[i] - want[i]) end
end
redis.call('HSET', KEYS[1], 'tokens', level[1], 'requests', level[2], 'at', now)
redis.call('EXPIRE', KEYS[1], 120)
return tostring(wait) .. ' ' .. which
"""


@dataclass(frozen=True)
class Budget:
    """A tenant's allowances per minute (0: unlimited)."""

    tokens: int = 0
    requests: int = 0

    @property
    def limited(self) -> bool:
        return self.tokens > 0 or self.requests > 0


@dataclass
class Reservation:
    """What one request took from its tenant's buckets (``settle`` gives back the rest)."""

    tenant: str
    budget: Budget
    tokens: int
    settled: bool = False


@dataclass
class _Bucket:
    tokens: float
    requests: float
    at: float


def parse_key_budgets(entries: tuple[str, ...], keys: tuple[str, ...]) -> dict[str, Budget]:
    """``("KEY=TOKENS/REQUESTS", ...)`` -> {key: Budget}; ValueError names a malformed
    entry or a key that is not among ``keys``."""
    out: dict[str, Budget] = {}
    for entry in entries:
        key, sep, limits = entry.rpartition("=")
        tokens, slash, requests = limits.partition("/")
        if not (sep and slash and tokens.isdigit() and requests.isdigit()):
            raise ValueError(
                f"key_budgets: {entry!r} is not 'KEY=TOKENS/REQUESTS' (whole numbers, 0: unlimited)"
            )
        if key not in keys:
            raise ValueError("key_budgets: a key that is not one of api_keys or admin_api_keys")
        out[key] = Budget(int(tokens), int(requests))
    return out


class TenantBudgets:
    """The budgets of every tenant (module docstring); ``default`` applies to tenants
    without one of their own."""

    def __init__(
        self, default: Budget, per_tenant: dict[str, Budget], redis_url: str, clock: Clock = time.monotonic
    ) -> None:
        self.default = default
        self.per_tenant = per_tenant
        self.shared = bool(redis_url)
        self._redis = redis_client.connect(redis_url) if redis_url else None
        self._script = self._redis.register_script(_RESERVE) if self._redis is not None else None
        self._local: dict[str, _Bucket] = {}
        self._settling: set[asyncio.Task[None]] = set()
        self.clock = clock

    @property
    def enabled(self) -> bool:
        """Whether any tenant has a budget."""
        return self.default.limited or any(b.limited for b in self.per_tenant.values())

    def budget_of(self, tenant: str) -> Budget:
        return self.per_tenant.get(tenant, self.default)

    async def reserve(self, tenant: str, tokens: int, klass: str = "default") -> Reservation | None:
        """Takes one request and ``tokens`` from ``tenant``'s buckets; None when it has no
        budget. APIError 429 (with ``Retry-After``) when they cannot cover it now (counted
        under the request's priority class ``klass``)."""
        budget = self.budget_of(tenant)
        if not budget.limited:
            return None
        wait, which = await self._take(tenant, budget, tokens, 1)
        if wait < 0:
            metrics.ADMISSIONS.labels(tenant, klass, "budget_too_large").inc()
            raise APIError(
                429,
                f"this request may use {tokens} tokens (prompt + n × max_tokens), more than the "
                f"budget of {budget.tokens} tokens per minute: lower max_tokens",
                param="max_tokens",
                code="token_budget_exceeded",
            )
        if wait > 0:
            metrics.ADMISSIONS.labels(tenant, klass, "budget_" + _BUCKETS[which]).inc()
            raise APIError(
                429,
                f"budget exceeded: {budget.tokens or 'unlimited'} tokens and "
                f"{budget.requests or 'unlimited'} requests per minute",
                code="budget_exceeded",
                headers={"Retry-After": RateLimiter.retry_after_header(wait)},
            )
        return Reservation(tenant, budget, tokens)

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Gives back the tokens ``reservation`` took and the request did not use (once)."""
        if reservation.settled:
            return
        reservation.settled = True
        unused = reservation.tokens - used_tokens
        if unused > 0 and reservation.budget.tokens:
            await self._take(reservation.tenant, reservation.budget, -unused, 0)

    def settle_soon(self, reservation: Reservation, used_tokens: int) -> None:
        """`settle` from synchronous code (a response's close), in the background."""
        task = asyncio.get_running_loop().create_task(self.settle(reservation, used_tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _take(self, tenant: str, budget: Budget, tokens: int, requests: int) -> tuple[float, int]:
        """(wait, bucket) as the Lua script answers, from Redis or else this process."""
        if self._script is not None:
            args = [budget.tokens, budget.requests, tokens, requests]
            try:
                wait, which = (await self._script(keys=[_PREFIX + tenant], args=args)).split()
                return float(wait), int(which)
            except (RedisError, OSError) as exc:
                log.warning("budgets: redis failed, counting in this process meanwhile: %s", exc)
        return self._take_local(tenant, budget, tokens, requests)

    def _take_local(self, tenant: str, budget: Budget, tokens: int, requests: int) -> tuple[float, int]:
        """The Lua script's arithmetic on this process's own bucket."""
        now = self.clock()
        bucket = self._local.get(tenant)
        if bucket is None:
            if len(self._local) >= _MAX_LOCAL:
                self._local.clear()
            bucket = self._local[tenant] = _Bucket(budget.tokens, budget.requests, now)
        elapsed = max(0.0, now - bucket.at)
        caps, want = (budget.tokens, budget.requests), (tokens, requests)
        level = [
            min(cap, held + elapsed * cap / 60)
            for cap, held in zip(caps, (bucket.tokens, bucket.requests), strict=True)
        ]
        wait, which = 0.0, 0
        for i, (cap, have, need) in enumerate(zip(caps, level, want, strict=True), start=1):
            if cap > 0 and need > 0:
                if need > cap:
                    return -1.0, i
                if (need - have) * 60 / cap > wait:
                    wait, which = (need - have) * 60 / cap, i
        if wait == 0:
            level = [min(cap, have - need) for cap, have, need in zip(caps, level, want, strict=True)]
        bucket.tokens, bucket.requests, bucket.at = level[0], level[1], now
        return wait, which

    async def close(self) -> None:
        """Settles what is pending and closes the Redis connection."""
        if self._settling:
            await asyncio.wait(self._settling, timeout=2.0)
        if self._redis is not None:
            await self._redis.aclose()


def tenant_budgets(config: GatewayConfig) -> TenantBudgets:
    """The budgets ``config`` declares, each key's under its tenant id."""
    from gateway.middleware import tenant_of

    default = Budget(config.tokens_per_minute_per_key, config.requests_per_minute_per_key)
    keys = parse_key_budgets(config.key_budgets, config.api_keys + config.admin_api_keys)
    budgets = TenantBudgets(default, {tenant_of(k): b for k, b in keys.items()}, config.redis_url)
    if budgets.enabled:
        where = (
            "shared by the replicas in redis"
            if budgets.shared
            else "counted in this process only (no --redis-url)"
        )
        log.info("tenant budgets: %s", where)
    return budgets
