"""The plot of a `bench.routing_bench` report (`--plot OUT.png`).

A `routing_bench` report (results keyed "c=N", then by policy) is drawn per policy: TTFT
p50 / p99 (medians over the repeats) and output throughput against the concurrency. An
open-loop report (keyed "rate=R", sessions/s) is drawn against the offered request rate
(R x turns): TTFT p50 / p99, the achieved request rate (the diagonal is "keeps up"), and
the requests the client had in flight (the queue anywhere in the mesh), time-averaged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.routing_workload import BenchConfig, session_count, zero_latency_request_rate

ROUTING_SERIES = (("ttft_ms.p50", "TTFT p50", "-o"), ("ttft_ms.p99", "TTFT p99", "--^"))
ROUTING_THROUGHPUT = (("output_throughput", "output tok/s", "-o"),)
POLICY_COLORS = ("tab:green", "tab:blue", "tab:orange", "tab:red")


OPEN_LOOP_RATE = (("open_loop.achieved_request_rate", "achieved req/s", "-o"),)
OPEN_LOOP_QUEUE = (("open_loop.client_in_flight.mean", "requests in flight (mean)", "-o"),)


def load_x(load: str, turns: int) -> float:
    """The x value of a result key: "c=N" -> N; "rate=R" (sessions/s) -> R x turns (requests/s)."""
    kind, value = load.split("=")
    return float(value) * turns if kind == "rate" else int(value)


def routing_series(report: dict[str, Any]) -> dict[str, dict[str, list[Any]]]:
    """Per policy: x (concurrency or offered request rate, ascending) and the median of
    each routing metric (None where a run has no such figure)."""
    turns = int(report.get("config", {}).get("turns", 1))
    series: dict[str, dict[str, list[Any]]] = {}
    loads = sorted(report["results"].items(), key=lambda item: load_x(item[0], turns))
    for load, by_policy in loads:
        for policy, result in by_policy.items():
            s = series.setdefault(policy, {"x": []})
            s["x"].append(load_x(load, turns))
            for key, _, _ in (*ROUTING_SERIES, *ROUTING_THROUGHPUT, *OPEN_LOOP_RATE, *OPEN_LOOP_QUEUE):
                s.setdefault(key, []).append(result["median"].get(key))
    return series


def _draw_routing(
    ax: Any, series: dict[str, dict[str, list[Any]]], spec: Sequence[tuple[str, str, str]]
) -> None:
    """One line per (policy, metric) of `spec`; None values skipped."""
    for color, (policy, s) in zip(POLICY_COLORS * 4, series.items(), strict=False):
        for key, name, style in spec:
            pts = [(x, y) for x, y in zip(s["x"], s[key], strict=True) if y is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, color=color, label=f"{policy} {name}")
    ax.set_xticks(sorted({x for s in series.values() for x in s["x"]}))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def zero_latency_line(report: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Per offered rate, the request rate a mesh answering instantly would achieve on the
    report's schedule (recomputed from its config: the arrivals are seeded)."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in report["config"].items()}
    base = BenchConfig(**fields)
    turns = base.turns
    rates = sorted(float(load.split("=")[1]) for load in report["results"])
    line = [zero_latency_request_rate(replace(base, session_rate=r), session_count(base, r)) for r in rates]
    return [r * turns for r in rates], line


def _sessions_label(cfg: dict[str, Any], sizes: dict[str, Any]) -> str:
    if cfg.get("duration"):
        return f"over {cfg['duration']:g} s"
    return f"{sizes.get('sessions', '?')} sessions"


def plot_routing(report: dict[str, Any], out: str | Path) -> Path:
    """TTFT p50/p99 and throughput vs load, one colour per routing policy; an open-loop
    report gets the achieved rate and the mean queue instead of token throughput."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    series = routing_series(report)
    open_loop = any(str(load).startswith("rate=") for load in report["results"])
    fig = Figure(figsize=(19, 5) if open_loop else (13, 5))
    axes = fig.subplots(1, 3 if open_loop else 2)
    specs = (
        (ROUTING_SERIES, OPEN_LOOP_RATE, OPEN_LOOP_QUEUE)
        if open_loop
        else (ROUTING_SERIES, ROUTING_THROUGHPUT)
    )
    for ax, spec in zip(axes, specs, strict=True):
        _draw_routing(ax, series, spec)
        ax.set_xlabel("offered load (requests/s)" if open_loop else "concurrency (conversations in flight)")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].set_title("TTFT vs load (median of repeats)")
    if open_loop:
        axes[0].set_yscale("log")  # light load ~100 ms, overload seconds
        xs, ideal = zero_latency_line(report)
        axes[1].plot(xs, ideal, ":", color="gray", label="a mesh answering instantly")
        axes[1].legend(fontsize="small")
        axes[1].set_ylabel("requests/s")
        axes[1].set_title("Achieved vs offered request rate")
        axes[2].set_ylabel("requests")
        axes[2].set_title("Requests in flight (queued + running), time-averaged")
    else:
        axes[1].set_ylabel("output tok/s")
        axes[1].set_title("Throughput vs load")
    cfg, sizes = report.get("config", {}), report.get("sizes", {})
    mode = (
        f"open loop, Poisson session arrivals ({_sessions_label(cfg, sizes)}), {cfg.get('turns', '?')} turns each, "
        f"think time {cfg.get('think_time', 0):g} s"
        if open_loop
        else "closed loop"
    )
    fig.suptitle(
        f"routing_bench: {cfg.get('workers', '?')} workers, {mode}; working set "
        f"{sizes.get('working_set_blocks', '?')} blocks ({cfg.get('conversations', '?')} conversations), "
        f"{sizes.get('kv_blocks_per_worker', '?')} KV blocks per worker"
    )
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    return path
