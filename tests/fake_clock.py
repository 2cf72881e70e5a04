"""A clock the test moves by hand, for domain code that takes a `services.clock.Clock`."""

from __future__ import annotations


class FakeClock:
    """Reads `now` (seconds); `advance` moves it forward."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Moves the clock `seconds` forward; returns the new time."""
        self.now += seconds
        return self.now
