"""The clock type that time-window domain code takes (lease TTLs, heartbeat staleness,
cache ages, rate buckets, hand-off TTLs): a function returning seconds on a monotonic
scale. Production passes `time.monotonic`; tests pass a fake they advance, so a window's
behaviour does not depend on how busy the host is."""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]
