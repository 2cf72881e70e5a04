"""Per-tenant token-bucket rate limiting (requests per second)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from services.clock import Clock

_MAX_BUCKETS = 100_000


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """One token bucket per tenant: `rate` tokens/s refill, `burst` capacity."""

    def __init__(self, rate: float, burst: int = 0, clock: Clock = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self.capacity = float(burst) if burst > 0 else max(1.0, rate)
        self._buckets: dict[str, _Bucket] = {}

    @property
    def enabled(self) -> bool:
        """False when the limit is off (rate 0)."""
        return self.rate > 0

    def acquire(self, tenant: str) -> float:
        """Takes one token; returns 0 on success, else seconds until one is available."""
        if not self.enabled:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:
                self._buckets.clear()
            bucket = self._buckets[tenant] = _Bucket(self.capacity, now)
        bucket.tokens = min(self.capacity, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate

    @staticmethod
    def retry_after_header(wait_s: float) -> str:
        """`Retry-After` value (whole seconds, at least 1)."""
        return str(max(1, math.ceil(wait_s)))
