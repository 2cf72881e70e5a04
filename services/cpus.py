"""The CPUs a process may use, and how the launcher shares a machine's CPUs between the
engines it starts (docs/design-decisions.md, "Engines on one machine get disjoint cores").

Two rules live here because two programs apply them: the worker sizes its torch threads
from `usable_threads` when started alone, and the launcher places the engine processes it
starts with `place_engines`, each on cores of its own with a matching thread count.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity() -> list[int]:
    """The CPUs this process may run on (all online CPUs where the OS has no affinity)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _own_cgroups(proc_cgroup: Path) -> dict[str, str]:
    """Controller -> this process's cgroup path, from /proc/self/cgroup ("" for v2)."""
    found: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = path
    return found


def _quota_at(directory: Path, v2: bool) -> float | None:
    """The CPU quota set in one cgroup directory, in CPUs (None: unlimited or unreadable)."""
    try:
        if v2:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1") or int(period) <= 0:
        return None
    return int(quota) / int(period)


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota (in CPUs, e.g. 1.5) of this process's cgroup and its parents,
    v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`); None when none is set, as Kubernetes leaves a
    container without a CPU limit."""
    groups = _own_cgroups(proc_cgroup)
    if "" in groups and (root / "cgroup.controllers").exists():
        base, v2 = root, True
    elif "cpu" in groups:
        base, v2 = root / "cpu", False
    else:
        return None
    path = Path(groups["" if v2 else "cpu"].lstrip("/"))
    limits = [q for d in (path, *path.parents) if (q := _quota_at(base / d, v2)) is not None]
    return min(limits) if limits else None


def usable_threads(cpus: int | None = None, limit: float | None = None) -> int:
    """Compute threads for a process that may run on `cpus` CPUs (default: its affinity)
    under a cgroup quota of `limit` CPUs (default: read from its cgroup): no more threads
    than either allows, a fractional quota rounded up (as the chart's "auto" does)."""
    count = len(affinity()) if cpus is None else cpus
    quota = cgroup_cpu_limit() if limit is None else limit
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)


def format_cpus(cpus: Sequence[int] | frozenset[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5" (the form of taskset and /proc/PID/status)."""
    ordered = sorted(cpus)
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


@dataclass(frozen=True)
class Placement:
    """Where one process runs: its CPUs (empty: wherever the launcher may) and its torch
    threads (0: the process sizes them itself)."""

    cpus: frozenset[int] = frozenset()
    threads: int = 0
    shared: bool = False  # its CPUs are also another engine's (too few CPUs for all)


@dataclass(frozen=True)
class Plan:
    """The launcher's placement: each engine's, and the CPUs the other services share."""

    engines: dict[str, Placement]
    rest: frozenset[int]  # the front-ends' CPUs; empty: they run on every CPU, beside the engines


def _threads(cpus: int, total: int, limit: float | None) -> int:
    """A share of `cpus` of `total` CPUs under a quota of `limit` CPUs for all of them."""
    return usable_threads(cpus, None if limit is None else limit * cpus / total)


def _split(
    cpus: Sequence[int], names: Sequence[str], limit: float | None
) -> tuple[dict[str, Placement], list[int]]:
    """Equal disjoint blocks of `cpus` for `names` (what does not divide is left over); with
    fewer CPUs than names, one CPU each, round robin, marked shared."""
    if len(cpus) < len(names):
        placed = {n: Placement(frozenset({cpus[i % len(cpus)]}), 1, True) for i, n in enumerate(names)}
        return placed, []
    size = len(cpus) // len(names)
    placed = {
        n: Placement(frozenset(cpus[i * size : (i + 1) * size]), _threads(size, len(cpus), limit))
        for i, n in enumerate(names)
    }
    return placed, list(cpus[len(names) * size :])


def place_engines(
    cpus: Sequence[int], main: Sequence[str], side: Sequence[str], limit: float | None = None
) -> Plan:
    """Shares `cpus` between engine processes: `main` ones (decoders, prefill workers: steady
    compute) each get an equal disjoint block with as many threads; `side` ones (encoders,
    the embedding worker: bursty, small models) get one CPU of their own only where every
    main engine still keeps two, else they run with one thread on the front-ends' CPUs.
    CPUs that do not divide evenly go to the front-ends (gateway, tokenizer, scheduler);
    with none left those run on every CPU, where the engines' idle-priority step threads
    yield to them (EngineConfig.engine_priority). `limit` is a cgroup quota over all `cpus`."""
    cpus = sorted(cpus)
    if not main:
        main, side = side, []
    if not main:
        return Plan({}, frozenset())
    own_side = list(side) if len(cpus) >= 2 * len(main) + len(side) else []
    placed, rest = _split(cpus[: len(cpus) - len(own_side)], main, limit)
    for name, cpu in zip(own_side, cpus[len(cpus) - len(own_side) :], strict=True):
        placed[name] = Placement(frozenset({cpu}), _threads(1, len(cpus), limit))
    shared_rest = frozenset(rest) or frozenset(cpus)
    for name in side:
        placed.setdefault(name, Placement(shared_rest, 1, not rest))
    return Plan(placed, frozenset(rest))
