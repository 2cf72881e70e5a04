"""AdmissionQueue: bounded, priorities, per-tenant round-robin, groups that cannot run."""

from __future__ import annotations

import pytest

from scheduler_svc.admission import AdmissionQueue
from services.errors import Code, Overloaded


def drain_all(queue: AdmissionQueue[str], limit: int = 1000) -> list[str]:
    taken: list[str] = []

    def take(item: str) -> bool:
        if len(taken) >= limit:
            return False
        taken.append(item)
        return True

    queue.drain(take, lambda item: "all")
    return taken


def test_priorities_first_then_fifo() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(10)
    queue.push("low1", priority=0)
    queue.push("high1", priority=5)
    queue.push("low2", priority=0)
    queue.push("mid", priority=1)
    queue.push("high2", priority=5)
    assert drain_all(queue) == ["high1", "high2", "mid", "low1", "low2"]
    assert len(queue) == 0


def test_tenants_take_turns_within_a_priority() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(100)
    for i in range(4):
        queue.push(f"a{i}", tenant="a")
    queue.push("b0", tenant="b")
    queue.push("b1", tenant="b")
    queue.push("c0", tenant="c")
    assert drain_all(queue) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_fairness_carries_across_drains() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(100)
    for i in range(3):
        queue.push(f"a{i}", tenant="a")
        queue.push(f"b{i}", tenant="b")
    assert drain_all(queue, limit=1) == ["a0"]
    # One slot at a time: b goes next, then a again.
    taken = [drain_all(queue, limit=1)[0] for _ in range(3)]
    assert taken == ["b0", "a1", "b1"]


def test_overflow_raises_overloaded_and_retries_bypass_the_limit() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(2)
    queue.push("x")
    queue.push("y")
    with pytest.raises(Overloaded, match="queue is full") as info:
        queue.push("z")
    assert info.value.code is Code.RESOURCE_EXHAUSTED
    queue.push("retry", front=True)
    assert drain_all(queue) == ["retry", "x", "y"]


def test_zero_length_queue_rejects_everything() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(0)
    with pytest.raises(Overloaded):
        queue.push("x")


def test_blocked_group_does_not_block_other_groups() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(10)
    for item in ["A1", "B1", "A2", "B2"]:
        queue.push(item, tenant="t")
    offered: list[str] = []

    def take(item: str) -> bool:
        offered.append(item)
        return item.startswith("B")

    assert queue.drain(take, lambda item: item[0]) == 2
    assert offered == ["A1", "B1", "B2"]  # A2 never offered once group A was blocked
    assert sorted(queue.items()) == ["A1", "A2"]


def test_remove() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(10)
    queue.push("x", priority=1, tenant="t")
    assert "x" in queue
    assert queue.remove("x")
    assert not queue.remove("x")
    assert len(queue) == 0 and drain_all(queue) == []
