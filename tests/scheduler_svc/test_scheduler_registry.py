"""WorkerRegistry: registration, heartbeats, timeouts, draining, suspects, leases."""

from __future__ import annotations

import pytest

from scheduler_svc.registry import Health, LoadSnapshot, WorkerRegistry, WorkerSpec
from tests.fake_clock import FakeClock


def spec(worker_id: str = "w1", model: str = "m", role: str = "decoder", seqs: int = 4) -> WorkerSpec:
    return WorkerSpec(
        worker_id, f"127.0.0.1:{hash(worker_id) % 1000 + 1000}", role, model, 512, 16, 100, seqs
    )


def make(clock: FakeClock, inflight: int = 0) -> WorkerRegistry:
    return WorkerRegistry(timeout_s=3.0, forget_s=30.0, max_inflight_per_worker=inflight, clock=clock)


def test_register_and_heartbeat_unknown_worker() -> None:
    clock = FakeClock(100.0)
    reg = make(clock)
    state, is_new = reg.register(spec())
    assert is_new and state.healthy and state.capacity == 4
    assert reg.heartbeat("w1", LoadSnapshot(num_running=2), draining=False) == (True, False)
    assert reg.get("w1") is not None and reg.get("w1").load.num_running == 2  # type: ignore[union-attr]
    assert reg.heartbeat("nobody", LoadSnapshot(), draining=False) == (False, False)
    _, again = reg.register(spec())
    assert not again


@pytest.mark.parametrize(
    "bad",
    [
        WorkerSpec("", "a:1", "decoder", "m"),
        WorkerSpec("w", "", "decoder", "m"),
        WorkerSpec("w", "a:1", "nope", "m"),
        WorkerSpec("w", "a:1", "decoder", ""),
        WorkerSpec("w", "a:1", "decoder", "m", block_size=0),
    ],
)
def test_register_rejects_bad_spec(bad: WorkerSpec) -> None:
    with pytest.raises(ValueError, match="worker"):
        make(FakeClock(100.0)).register(bad)


def test_silent_worker_marked_down_then_revived_then_forgotten() -> None:
    clock = FakeClock(100.0)
    reg = make(clock)
    reg.register(spec("w1"))
    reg.register(spec("w2"))
    clock.now += 2.0
    reg.heartbeat("w2", LoadSnapshot(), False)
    clock.now += 1.5
    assert reg.sweep() == (["w1"], [])
    assert reg.get("w1").health is Health.UNHEALTHY  # type: ignore[union-attr]
    assert [w.worker_id for w in reg.candidates("m", "decoder")] == ["w2"]
    assert reg.heartbeat("w1", LoadSnapshot(), False) == (True, True)
    assert {w.worker_id for w in reg.candidates("m", "decoder")} == {"w1", "w2"}
    clock.now += 31.0
    down, gone = reg.sweep()
    assert sorted(gone) == ["w1", "w2"] and not down
    assert reg.all() == []


def test_draining_and_suspect_workers_leave_routing() -> None:
    clock = FakeClock(100.0)
    reg = make(clock)
    reg.register(spec("w1"))
    reg.register(spec("w2"))
    reg.heartbeat("w1", LoadSnapshot(), draining=True)
    assert [w.worker_id for w in reg.candidates("m", "decoder")] == ["w2"]
    assert reg.get("w1").health is Health.DRAINING  # type: ignore[union-attr]
    reg.mark_suspect("w2", 2.0)
    # The only routable worker is a suspect: still used as a last resort.
    assert [w.worker_id for w in reg.candidates("m", "decoder")] == ["w2"]
    reg.heartbeat("w1", LoadSnapshot(), draining=False)
    assert [w.worker_id for w in reg.candidates("m", "decoder")] == ["w1"]
    clock.now += 2.5
    assert {w.worker_id for w in reg.candidates("m", "decoder")} == {"w1", "w2"}
    assert [w.worker_id for w in reg.candidates("m", "decoder", exclude={"w1"})] == ["w2"]


def test_roles_models_and_counts() -> None:
    reg = make(FakeClock(100.0))
    reg.register(spec("d1"))
    reg.register(spec("e1", model="emb", role="embedding"))
    assert reg.models() == ["emb", "m"]
    assert [w.worker_id for w in reg.serving("emb", "embedding")] == ["e1"]
    assert reg.serving("emb", "decoder") == []
    counts = reg.counts()
    assert counts[("decoder", Health.HEALTHY)] == 1
    assert counts[("embedding", Health.HEALTHY)] == 1
    assert counts[("encoder", Health.UNHEALTHY)] == 0


def test_leases_capacity_and_load_estimate() -> None:
    clock = FakeClock(100.0)
    reg = make(clock, inflight=2)
    state, _ = reg.register(spec("w1", seqs=8))
    assert state.capacity == 2
    first = reg.acquire(state)
    reg.acquire(state)
    assert not state.has_capacity()
    assert state.estimated_load() == 2
    clock.now += 0.1
    reg.heartbeat("w1", LoadSnapshot(num_running=5, num_waiting=1), False)
    # The report includes our 2 requests: 4 come from elsewhere (no double counting).
    assert state.external_load == 4 and state.estimated_load() == 6
    reg.release(first)
    # Our own count is exact between heartbeats.
    assert state.inflight == 1 and state.has_capacity()
    assert state.estimated_load() == 5


def test_observe_remote_entries() -> None:
    clock = FakeClock(100.0)
    reg = make(clock)
    assert reg.observe_remote(spec("r1"), LoadSnapshot(num_running=3), False, age_s=0.5)
    state = reg.get("r1")
    assert state is not None and state.healthy and state.load.num_running == 3
    # Older than what we have: ignored. Older than the timeout: ignored.
    assert not reg.observe_remote(spec("r1"), LoadSnapshot(num_running=9), False, age_s=1.0)
    assert not reg.observe_remote(spec("r2"), LoadSnapshot(), False, age_s=10.0)
    assert reg.get("r2") is None
