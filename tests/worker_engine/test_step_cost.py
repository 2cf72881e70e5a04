"""StepCost: the plane of step seconds over rows and tokens that sizes the lower
priorities' share of a step."""

from __future__ import annotations

import random

import pytest

from worker_svc.engine.step_cost import Share, StepCost


def _cpu_step(rows: int, tokens: int) -> float:
    """A CPU engine's step: a decode row costs far more than a prompt token."""
    return 0.020 + 0.0015 * rows + 0.0002 * tokens


def test_rows_and_tokens_are_told_apart() -> None:
    cost = StepCost()
    rng = random.Random(3)
    for _ in range(200):  # a flood's steps: decodes, decodes beside a prompt, a prompt alone
        rows, tokens = rng.choice(((64, 64), (64, 127), (2, 65), (66, 66)))
        cost.add(rows, tokens, _cpu_step(rows, tokens) * rng.uniform(0.98, 1.02))
    plane = cost.plane()
    assert plane is not None
    fixed, per_row, per_token = plane
    assert fixed == pytest.approx(0.020, rel=0.2)
    assert per_row == pytest.approx(0.0015, rel=0.1) and per_token == pytest.approx(0.0002, rel=0.2)


def test_decode_steps_alone_split_the_slope_and_a_flat_gpu_step_has_none() -> None:
    decode = StepCost()
    for rows in (1, 8, 64) * 10:
        decode.add(rows, rows, 0.020 + 0.0017 * rows)
    plane = decode.plane()
    assert plane is not None and plane[1] + plane[2] == pytest.approx(0.0017, rel=0.01)
    flat = StepCost()
    for rows in (1, 256) * 10:
        flat.add(rows, rows, 0.030 if rows == 1 else 0.029)  # no cost per row: no plane
    assert flat.plane() is None
    early = StepCost()
    for rows in (1, 64, 1):
        early.add(rows, rows, 0.02 * rows)
    assert early.plane() is None  # too few steps yet


def test_the_share_keeps_the_step_within_the_ratio() -> None:
    cost = StepCost()
    for rows, tokens in ((64, 64), (64, 127), (2, 65), (66, 66)) * 20:
        cost.add(rows, tokens, _cpu_step(rows, tokens))
    share = cost.share(2, 2, ratio=2.0)  # two decode rows of the highest priority
    assert share is not None
    rows = 0
    while share.take(1):
        rows += 1
    alone = _cpu_step(2, 2)
    assert _cpu_step(2 + rows, 2 + rows) <= 2.0 * alone + 1e-9 < _cpu_step(3 + rows, 3 + rows)
    chunk = Share(seconds=0.010, per_row=0.002, per_token=0.0002)
    assert chunk.take(100) == 40 and chunk.take(1) == 0  # a prompt chunked to what is left


def test_recent_steps_outweigh_old_ones_and_bad_samples_are_ignored() -> None:
    cost = StepCost(decay=0.9)
    for rows, tokens in ((1, 1), (64, 64), (1, 64)) * 30:
        cost.add(rows, tokens, _cpu_step(rows, tokens))
    for rows, tokens in ((1, 1), (64, 64), (1, 64)) * 30:  # twice slower per row now
        cost.add(rows, tokens, _cpu_step(rows, tokens) + 0.0015 * rows)
    plane = cost.plane()
    assert plane is not None and plane[1] == pytest.approx(0.003, rel=0.05)
    cost.add(0, 5, 1.0)
    cost.add(5, 4, 1.0)  # fewer tokens than rows
    cost.add(5, 5, -1.0)
    assert cost.plane() == plane
