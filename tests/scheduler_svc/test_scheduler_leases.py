"""LeaseTable with a fake clock: issue, release, heartbeat reconciliation with a grace
period, TTL expiry and a lost worker's leases; the state each lease ends in."""

from __future__ import annotations

import pytest

from scheduler_svc.leases import LeaseRecord, LeaseState, LeaseTable
from scheduler_svc.registry import Lease, WorkerSpec, WorkerState
from tests.fake_clock import FakeClock

WORKERS = {name: WorkerState(WorkerSpec(name, f"{name}:1", model="m")) for name in ("a", "b")}


def lease(worker: str) -> Lease:
    return Lease(WORKERS[worker], 0.0)


def table(ttl_s: float = 60.0, grace_s: float = 2.0) -> tuple[LeaseTable, FakeClock]:
    clock = FakeClock(100.0)
    return LeaseTable(ttl_s, grace_s, clock, replica_id="rep1"), clock


def ids(leases: list[LeaseRecord]) -> set[str]:
    return {lease.lease_id for lease in leases}


def test_issue_and_release() -> None:
    leases, _clock = table(ttl_s=30)
    first = leases.issue(lease("a"), "r1")
    second = leases.issue(lease("b"), "r2")
    assert first.lease_id != second.lease_id and first.lease_id.startswith("rep1-")
    assert (first.request_id, first.worker_id, first.issued_at, first.expires_at) == ("r1", "a", 100.0, 130.0)
    assert first.state is LeaseState.ISSUED and leases.get(first.lease_id) is first
    assert len(leases) == 2
    ended = leases.release([first.lease_id, "unknown", first.lease_id])
    assert [e.lease_id for e in ended] == [first.lease_id]  # once, unknown ids ignored
    assert ended[0].lease is first.lease  # the slot to hand back
    assert first.state is LeaseState.RELEASED and leases.get(first.lease_id) is None
    assert leases.release([first.lease_id]) == []
    assert len(leases) == 1


def test_replica_ids_default_unique() -> None:
    clock = FakeClock(100.0)
    one, two = LeaseTable(1, 1, clock), LeaseTable(1, 1, clock)
    prefix = one.issue(lease("a"), "r").lease_id.split("-")[0]
    assert prefix and prefix != two.issue(lease("a"), "r").lease_id.split("-")[0]


def test_reconcile_ends_unreported_leases_after_the_grace() -> None:
    leases, clock = table(grace_s=2.0)
    reported = leases.issue(lease("a"), "r1")
    unreported = leases.issue(lease("a"), "r2")
    other_worker = leases.issue(lease("b"), "r3")
    clock.now += 1.0
    fresh = leases.issue(lease("a"), "r4")
    # Inside the grace nothing ends, reported or not.
    assert leases.reconcile("a", []) == []
    clock.now += 1.0  # r1, r2 are exactly grace_s old; r4 is 1 s old
    ended = leases.reconcile("a", [reported.lease_id])
    assert ids(ended) == {unreported.lease_id} and unreported.state is LeaseState.RECONCILED
    assert reported.state is LeaseState.RUNNING and fresh.state is LeaseState.ISSUED
    # Other workers' leases are not this heartbeat's business; the fresh one is kept.
    assert ids(leases.release([other_worker.lease_id, fresh.lease_id])) == {
        other_worker.lease_id,
        fresh.lease_id,
    }
    assert other_worker.state is LeaseState.RELEASED
    # A lease unreported later (its request ended without a release) ends once the grace
    # has passed since its worker last reported it -- not at once: the gateway's release,
    # which carries the request's outcome, may come after the worker's next heartbeat.
    assert leases.reconcile("a", []) == []
    clock.now += 1.9
    assert leases.reconcile("a", []) == [] and reported.state is LeaseState.RUNNING
    clock.now += 0.1
    assert ids(leases.reconcile("a", [])) == {reported.lease_id}
    assert reported.state is LeaseState.RECONCILED and len(leases) == 0


def test_an_ended_lease_moves_no_more() -> None:
    leases, _clock = table()
    record = leases.issue(lease("a"), "r1")
    leases.release([record.lease_id])
    for state in LeaseState:
        with pytest.raises(ValueError, match="is not allowed"):
            record.move(state)
    assert record.state is LeaseState.RELEASED
    with pytest.raises(ValueError, match="issued -> issued"):
        leases.issue(lease("a"), "r2").move(LeaseState.ISSUED)


def test_reconcile_ignores_unknown_reported_ids() -> None:
    leases, _clock = table(grace_s=0.0)
    mine = leases.issue(lease("a"), "r1")
    assert leases.reconcile("a", ["other-replica-lease", mine.lease_id]) == []
    assert len(leases) == 1


def test_expire_ends_leases_past_their_ttl() -> None:
    leases, clock = table(ttl_s=10.0)
    old = leases.issue(lease("a"), "r1")
    clock.now += 5.0
    young = leases.issue(lease("b"), "r2")
    clock.now += 4.9
    assert leases.expire() == []
    clock.now += 0.1
    assert ids(leases.expire()) == {old.lease_id} and old.state is LeaseState.EXPIRED
    clock.now += 5.0
    assert ids(leases.expire()) == {young.lease_id}
    assert len(leases) == 0


def test_reported_lease_outlives_its_ttl() -> None:
    """A lease its worker keeps reporting is renewed: a long request keeps its slot."""
    leases, clock = table(ttl_s=10.0, grace_s=1.0)
    running = leases.issue(lease("a"), "r1")
    for _ in range(4):
        clock.now += 5.0
        assert leases.reconcile("a", [running.lease_id]) == []
        assert leases.expire() == []
    assert len(leases) == 1


def test_of_worker_ends_every_lease_of_a_lost_worker() -> None:
    leases, _clock = table()
    on_a = {leases.issue(lease("a"), f"r{i}").lease_id for i in range(3)}
    on_b = leases.issue(lease("b"), "rb")
    lost = leases.of_worker("a")
    assert ids(lost) == on_a and {r.state for r in lost} == {LeaseState.WORKER_DOWN}
    assert leases.of_worker("a") == []
    assert len(leases) == 1 and leases.release([on_b.lease_id])[0].worker_id == "b"
