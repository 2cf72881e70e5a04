"""Tokens per second measured over recent work, for the load a worker reports (its prompt
rate, its KV import rate): the scheduler's P/D decision estimates hand-offs with them."""

from __future__ import annotations

__all__ = ["TokenRate"]


class TokenRate:
    """Tokens over seconds of recent samples, each older sample weighing ``decay`` times
    the next: a long prompt counts by its tokens, not as one sample among many short ones."""

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError("decay must be in (0, 1)")
        self.decay = decay
        self._tokens = 0.0
        self._seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """One sample: ``tokens`` done in ``seconds`` (ignored unless both are positive)."""
        if tokens > 0 and seconds > 0.0:
            self._tokens = self._tokens * self.decay + tokens
            self._seconds = self._seconds * self.decay + seconds

    def reset(self) -> None:
        self._tokens = self._seconds = 0.0

    @property
    def per_s(self) -> float:
        """Tokens per second; 0.0 until a sample came."""
        return self._tokens / self._seconds if self._seconds > 0.0 else 0.0
