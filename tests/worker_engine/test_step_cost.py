"""StepCost: the line of step seconds over tokens the lower priorities' share is sized by."""

from __future__ import annotations

import random

import pytest

from worker_svc.engine.step_cost import StepCost


def test_the_line_is_fitted_from_steps_of_different_sizes() -> None:
    cost = StepCost()
    rng = random.Random(3)
    for _ in range(200):
        tokens = rng.choice((1, 2, 64, 66, 130))
        cost.add(tokens, (0.020 + 0.0017 * tokens) * rng.uniform(0.97, 1.03))
    line = cost.line()
    assert line is not None
    fixed, per_token = line
    assert fixed == pytest.approx(0.020, rel=0.15) and per_token == pytest.approx(0.0017, rel=0.05)


def test_no_line_from_steps_of_one_size_or_without_a_cost_per_token() -> None:
    same = StepCost()
    for _ in range(50):
        same.add(64, 0.13)
    assert same.line() is None
    flat = StepCost()
    for tokens in (1, 256) * 20:
        flat.add(tokens, 0.030 if tokens == 1 else 0.029)  # a GPU decode step: no slope
    assert flat.line() is None
    assert StepCost().line() is None


def test_recent_steps_outweigh_old_ones() -> None:
    cost = StepCost(decay=0.9)
    for tokens in (1, 100) * 50:
        cost.add(tokens, 0.010 + 0.001 * tokens)
    for tokens in (1, 100) * 50:  # the engine slowed down: twice the cost per token
        cost.add(tokens, 0.010 + 0.002 * tokens)
    line = cost.line()
    assert line is not None and line[1] == pytest.approx(0.002, rel=0.02)
    cost.add(0, 1.0)
    cost.add(5, -1.0)
    assert cost.line() == line  # empty or negative samples are ignored
