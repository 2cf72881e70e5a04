"""What an engine step costs: seconds as a line in the tokens it computes, fitted over the
engine's recent steps. The step scheduler sizes the lower priorities' share of a step with
it (worker_svc/engine/scheduler.py, "lower priorities' share")."""

from __future__ import annotations

__all__ = ["StepCost"]


class StepCost:
    """``seconds = fixed + per_token * tokens``, a least-squares line over recent steps,
    each older step weighing ``decay`` times the next (about ``1 / (1 - decay)`` steps).

    The fixed part is what a step costs whatever its size (kernel launches, reading the
    weights, the host's work); the slope what each token adds. On a GPU decode steps are
    mostly fixed cost; on a CPU the slope dominates a large batch."""

    def __init__(self, decay: float = 0.98) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError("decay must be in (0, 1)")
        self.decay = decay
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """One step of ``tokens`` that took ``seconds`` (ignored unless both are positive)."""
        if tokens <= 0 or seconds <= 0.0:
            return
        d = self.decay
        self._n = self._n * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None until recent steps differ enough in
        size to tell the two apart (or when they show no cost per token)."""
        if self._n < 2.0:
            return None
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var_x = self._xx / self._n - mean_x * mean_x
        if var_x < 1.0:  # every step about the same size: no slope to read
            return None
        per_token = (self._xy / self._n - mean_x * mean_y) / var_x
        if per_token <= 0.0:
            return None
        return max(0.0, mean_y - per_token * mean_x), per_token
