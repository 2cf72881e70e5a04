"""What an engine step costs: seconds as a plane in the rows it computes (sequences) and
the tokens they compute, fitted over the engine's recent steps. The step scheduler sizes
the lower priorities' share of a step with it (worker_svc/engine/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Share", "StepCost"]

# Steps before a fit is trusted, and the ridge (relative) that keeps it defined while the
# steps seen cannot tell rows from tokens (decode steps only: one token a row); the slope
# is then split evenly between the two, which prices a prompt's tokens high: safe.
MIN_STEPS = 8.0
RIDGE = 1e-6


@dataclass
class Share:
    """What is left of a step's time for more rows: ``take`` answers how many of a row's
    tokens still fit and counts them in."""

    seconds: float
    per_row: float
    per_token: float

    def take(self, tokens: int) -> int:
        """How many of ``tokens`` one more row may compute (0: the row does not fit);
        the time they cost is taken from the share."""
        room = self.seconds - self.per_row
        if room <= 0:
            return 0
        fits = tokens if self.per_token <= 0 else min(tokens, int(room / self.per_token))
        if fits > 0:
            self.seconds -= self.per_row + fits * self.per_token
        return fits


class StepCost:
    """``seconds = fixed + per_row * rows + per_token * tokens``, a least-squares plane over
    recent steps, each older step weighing ``decay`` times the next.

    Rows and tokens are told apart because they cost differently: on a CPU a decode row
    (its attention over its own context, its logits over the vocabulary, its draw) costs
    several prompt tokens of a chunk, and on a GPU a decode step is mostly its fixed part
    (kernel launches, reading the weights)."""

    def __init__(self, decay: float = 0.98) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError("decay must be in (0, 1)")
        self.decay = decay
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed sums of x x^T, x = (1, rows, tokens)
        self._xy = [0.0] * 3

    def add(self, rows: int, tokens: int, seconds: float) -> None:
        """One step of ``rows`` sequences computing ``tokens`` that took ``seconds``."""
        if rows <= 0 or tokens < rows or seconds <= 0.0:
            return
        x = (1.0, float(rows), float(tokens))
        for i in range(3):
            self._xy[i] = self._xy[i] * self.decay + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * self.decay + x[i] * x[j]

    def plane(self) -> tuple[float, float, float] | None:
        """(fixed, per row, per token) seconds, none negative, or None before ``MIN_STEPS``
        steps or when the fit gives a decode row (one row, one token) no cost."""
        if self._xx[0][0] < MIN_STEPS:
            return None
        a = [[*row, self._xy[i]] for i, row in enumerate(self._xx)]
        for i in (1, 2):
            a[i][i] *= 1.0 + RIDGE
        beta = _solve3(a)
        if beta is None or beta[1] + beta[2] <= 0.0:
            return None
        return max(0.0, beta[0]), max(0.0, beta[1]), max(0.0, beta[2])

    def share(self, rows: int, tokens: int, ratio: float) -> Share | None:
        """The time more rows may add to a step of ``rows`` computing ``tokens`` so that
        it takes at most ``ratio`` times what those alone would (None: no fit yet)."""
        plane = self.plane()
        if plane is None:
            return None
        fixed, per_row, per_token = plane
        alone = fixed + per_row * rows + per_token * tokens
        return Share((ratio - 1.0) * alone, per_row, per_token)


def _solve3(a: list[list[float]]) -> tuple[float, float, float] | None:
    """The solution of the 3x3 system ``a`` (augmented, modified), by Gaussian elimination
    with partial pivoting; None when it is singular."""
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for c in range(col, 4):
                a[r][c] -= f * a[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][c] * x[c] for c in range(r + 1, 3))) / a[r][r]
    return x[0], x[1], x[2]
