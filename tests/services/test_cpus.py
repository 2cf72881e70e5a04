"""How a machine's CPUs are shared: the launcher's placement of engines, and the threads a
worker started alone takes (its affinity, its cgroup's CPU quota)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import cpus
from services.cpus import Placement, cgroup_cpu_limit, format_cpus, place_engines, usable_threads


def _cpus(plan: cpus.Plan) -> dict[str, str]:
    return {name: format_cpus(p.cpus) for name, p in plan.engines.items()}


def test_engines_get_equal_disjoint_blocks_and_a_thread_per_cpu() -> None:
    plan = place_engines(range(8), ["decoder-0", "decoder-1"], [])
    assert _cpus(plan) == {"decoder-0": "0-3", "decoder-1": "4-7"}
    assert {p.threads for p in plan.engines.values()} == {4}
    assert plan.rest == frozenset()  # the front-ends run everywhere, beside the engines


def test_cpus_that_do_not_divide_go_to_the_front_ends() -> None:
    plan = place_engines(range(16), ["decoder-0", "decoder-1", "prefill-0"], ["embedding-0"])
    assert _cpus(plan) == {"decoder-0": "0-4", "decoder-1": "5-9", "prefill-0": "10-14", "embedding-0": "15"}
    assert plan.rest == frozenset()
    plan = place_engines(range(16), ["decoder-0", "decoder-1", "prefill-0"], [])
    assert format_cpus(plan.rest) == "15"


def test_two_engines_on_two_cpus_get_one_each() -> None:
    plan = place_engines([0, 1], ["decoder-0", "decoder-1"], [])
    assert plan.engines == {
        "decoder-0": Placement(frozenset({0}), 1),
        "decoder-1": Placement(frozenset({1}), 1),
    }


def test_a_side_engine_takes_no_cpu_a_main_engine_needs() -> None:
    """On two CPUs the decoder keeps both; the embedding worker runs one thread beside it."""
    plan = place_engines([0, 1], ["decoder-0"], ["embedding-0"])
    assert plan.engines["decoder-0"] == Placement(frozenset({0, 1}), 2)
    assert plan.engines["embedding-0"] == Placement(frozenset({0, 1}), 1, shared=True)
    plan = place_engines([0, 1, 2], ["decoder-0"], ["embedding-0"])
    assert _cpus(plan) == {"decoder-0": "0-1", "embedding-0": "2"}


def test_more_engines_than_cpus_share_them_round_robin_with_one_thread() -> None:
    plan = place_engines([3], ["decoder-0", "decoder-1"], [])
    assert plan.engines == {
        "decoder-0": Placement(frozenset({3}), 1, shared=True),
        "decoder-1": Placement(frozenset({3}), 1, shared=True),
    }


def test_side_engines_alone_are_placed_as_main_ones() -> None:
    assert _cpus(place_engines(range(4), [], ["encoder-0", "encoder-1"])) == {
        "encoder-0": "0-1",
        "encoder-1": "2-3",
    }
    assert place_engines(range(4), [], []).engines == {}


def test_a_cgroup_quota_caps_the_threads_of_each_share() -> None:
    plan = place_engines(range(16), ["decoder-0", "decoder-1"], [], limit=3.0)
    assert {p.threads for p in plan.engines.values()} == {2}  # 1.5 CPUs each, rounded up
    assert len(plan.engines["decoder-0"].cpus) == 8


def _cgroup_v2(root: Path, own: str, limits: dict[str, str]) -> Path:
    (root / "cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for path, value in limits.items():
        (root / path).mkdir(parents=True, exist_ok=True)
        (root / path / "cpu.max").write_text(value + "\n")
    proc = root.parent / "proc-cgroup"
    proc.write_text(f"0::/{own}\n")
    return proc


def test_cgroup_v2_quota_is_the_tightest_of_the_group_and_its_parents(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = _cgroup_v2(
        root, "kubepods/pod1/c1", {"kubepods": "400000 100000", "kubepods/pod1/c1": "150000 100000"}
    )
    assert cgroup_cpu_limit(root, proc) == 1.5
    proc = _cgroup_v2(root, "kubepods/pod1/c1", {"kubepods/pod1/c1": "max 100000", "kubepods": "max 100000"})
    assert cgroup_cpu_limit(root, proc) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    group = tmp_path / "cgroup" / "cpu" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("200000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_limit(tmp_path / "cgroup", proc) == 2.0
    (group / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path / "cgroup", proc) is None


def test_threads_follow_the_affinity_and_the_quota() -> None:
    assert usable_threads(8, None) == 8
    assert usable_threads(8, 2.5) == 3
    assert usable_threads(2, 16.0) == 2
    assert usable_threads(4, 0.1) == 1
    assert usable_threads(limit=1024.0) == len(cpus.affinity())


@pytest.mark.parametrize(("given", "text"), [({0, 1, 2, 5, 7, 8}, "0-2,5,7-8"), ({3}, "3"), (set(), "")])
def test_format_cpus(given: set[int], text: str) -> None:
    assert format_cpus(frozenset(given)) == text
