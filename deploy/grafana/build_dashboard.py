"""Writes deploy/grafana/meshserve-dashboard.json, the Grafana dashboard of docs/metrics.md.

    python deploy/grafana/build_dashboard.py          # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check  # exit 1 when the JSON is stale

Edit the panels here, not in the JSON (tests/deploy checks that both agree).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "meshserve-dashboard.json"

DS = {"type": "prometheus", "uid": "${datasource}"}
NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"
GEN_ROUTES = 'route=~"/v1/chat/completions|/v1/completions"'


def quantiles(metric: str, selector: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[dict[str, str]]:
    return [
        {
            "expr": f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            "legendFormat": f"p{round(q * 100)}",
        }
        for q in qs
    ]


class Layout:
    """Places panels left to right on Grafana's 24-column grid, rows top to bottom."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "panels": [],
                "id": len(self.panels) + 1,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            }
        )
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.x = 0
            self.y += self.row_h
            self.row_h = 0

    def panel(
        self,
        title: str,
        targets: list[dict[str, str]],
        *,
        unit: str = "short",
        description: str = "",
        kind: str = "timeseries",
        w: int = 8,
        h: int = 8,
        stack: bool = False,
        max_value: float | None = None,
    ) -> None:
        if self.x + w > 24:
            self._newline()
        defaults: dict[str, Any] = {"unit": unit}
        if max_value is not None:
            defaults["max"] = max_value
            defaults["min"] = 0
        if kind == "timeseries":
            defaults["custom"] = {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 20 if stack else 5,
                "showPoints": "never",
                "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            }
        panel: dict[str, Any] = {
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "id": len(self.panels) + 1,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
            if kind == "timeseries"
            else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
            "targets": [
                {"datasource": DS, "refId": chr(ord("A") + i), "range": True, **t}
                for i, t in enumerate(targets)
            ],
        }
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def target(expr: str, legend: str) -> dict[str, str]:
    """One query of a panel, with its legend."""
    return {"expr": expr, "legendFormat": legend}


def _aggregate(agg: str, by: str) -> str:
    return f"{agg} by ({by}) " if by else agg


def rate(metric: str, by: str = "", selector: str = NS) -> str:
    """A counter's per-second rate over the selected series, summed (per `by` labels)."""
    return f"{_aggregate('sum', by)}(rate({metric}{{{selector}}}[{RATE}]))"


def gauge(metric: str, by: str = "", agg: str = "sum") -> str:
    """A gauge over the namespace's series, aggregated with `agg` (per `by` labels)."""
    return f"{_aggregate(agg, by)}({metric}{{{NS}}})"


def mean(metric: str, by: str = "") -> str:
    """A histogram's mean over the rate interval: its `_sum` rate over its `_count` rate."""
    return f"{rate(metric + '_sum', by)} / {rate(metric + '_count', by)}"


def relabelled(targets: list[dict[str, str]], legend: str, expr: str = "{}") -> list[dict[str, str]]:
    """`targets` with each legend put into `legend` and each query into `expr` ("{}" is
    the original): quantiles of a second metric on the same panel."""
    return [target(expr.format(t["expr"]), legend.format(t["legendFormat"])) for t in targets]


def gateway_row(g: Layout) -> None:
    """Requests, errors, throughput and the latencies clients see."""
    g.row("Gateway")
    route = f'{NS}, route=~"$route"'
    g.panel(
        "Request rate by status",
        [target(rate("meshserve_gateway_requests_total", "status", route), "{{status}}")],
        unit="reqps",
        stack=True,
        description="HTTP requests answered per second, by status code (route filter above).",
    )
    errors = rate("meshserve_gateway_requests_total", selector=f'{route}, status=~"5.."')
    g.panel(
        "Error ratio (5xx)",
        [target(f"{errors} / {rate('meshserve_gateway_requests_total', selector=route)}", "5xx / all")],
        unit="percentunit",
    )
    g.panel(
        "Requests in flight / token throughput",
        [
            target(gauge("meshserve_gateway_requests_in_flight", "route"), "in flight {{route}}"),
            target(rate("meshserve_gateway_prompt_tokens_total"), "prompt tokens/s"),
            target(rate("meshserve_gateway_completion_tokens_total"), "completion tokens/s"),
        ],
    )
    sel = f"{NS}, {GEN_ROUTES}"
    for title, metric, selector in (
        ("Time to first token (TTFT)", "meshserve_gateway_time_to_first_token_seconds", sel),
        ("Time per output token (TPOT)", "meshserve_gateway_time_per_output_token_seconds", sel),
        ("Inter-token latency (ITL)", "meshserve_gateway_inter_token_latency_seconds", sel),
        ("End-to-end latency (E2E)", "meshserve_gateway_request_duration_seconds", route),
    ):
        g.panel(title, quantiles(metric, selector), unit="s", w=6)


def flow_control_row(g: Layout) -> None:
    """Tenants and priority classes: what each is admitted, refused, waits and uses."""
    g.row("Flow control (tenants and classes)")
    g.panel(
        "Admissions by class and outcome",
        [target(rate("meshserve_gateway_admissions_total", "class, outcome"), "{{class}} {{outcome}}")],
        unit="reqps",
        stack=True,
        description="Generation requests per second: admitted, refused by a tenant budget, or overloaded "
        "(the scheduler's queue full or timed out, or shed).",
    )
    by_class = f"histogram_quantile(0.99, sum by (le, class) (rate(meshserve_gateway_queued_seconds_bucket{{{NS}}}[{RATE}])))"
    g.panel(
        "Queued time p99 by class",
        [target(by_class, "{{class}}")],
        unit="s",
        description="A route's request to its lease at the gateway: the wait in the scheduler's queue.",
    )
    g.panel(
        "Tokens by tenant",
        [target(rate("meshserve_gateway_tenant_tokens_total", "tenant"), "{{tenant}}")],
        unit="short",
        stack=True,
        description="Prompt + completion tokens per second of admitted requests, by tenant.",
    )
    g.panel(
        "Refused by tenant",
        [
            target(
                rate("meshserve_gateway_admissions_total", "tenant, outcome", f'{NS}, outcome!="admitted"'),
                "{{tenant}} {{outcome}}",
            ),
            target(rate("meshserve_scheduler_shed_total", "reason"), "shed {{reason}}"),
        ],
        unit="reqps",
        description="429s per second by tenant and cause, and the scheduler's shed requests.",
    )
    g.panel(
        "Priority preemptions",
        [target(gauge("meshserve_worker_num_priority_preemptions"), "preemptions")],
        description="Running requests displaced on the workers by a waiting one of higher priority (total).",
    )


def scheduler_row(g: Layout) -> None:
    """Admission, worker health, routing and its failures, leases."""
    g.row("Scheduler")
    g.panel(
        "Admission queue",
        [
            target(gauge("meshserve_scheduler_queue_depth"), "queued"),
            target(gauge("meshserve_scheduler_worker_inflight", "worker_id"), "in flight {{worker_id}}"),
        ],
        description="Requests waiting for a worker slot, and requests in flight per worker.",
    )
    g.panel(
        "Worker health",
        [target(gauge("meshserve_scheduler_workers", "role, health", "max"), "{{role}} {{health}}")],
        description="Workers registered with the scheduler, by role and health.",
        stack=True,
    )
    healthy = f'max by (role) (meshserve_scheduler_workers{{{NS}, health="healthy"}})'
    g.panel("Workers healthy", [target(healthy, "{{role}}")], kind="stat", w=4)
    g.panel(
        "Redis reachable",
        [target(gauge("meshserve_scheduler_redis_up", agg="min"), "redis")],
        kind="stat",
        w=4,
    )
    g.panel(
        "Scheduling overhead / queue wait",
        [
            *quantiles("meshserve_scheduler_overhead_seconds", NS, (0.5, 0.99)),
            *relabelled(
                quantiles("meshserve_scheduler_queue_wait_seconds", NS, (0.5, 0.99)), "queue wait {}"
            ),
        ],
        unit="s",
    )
    g.panel(
        "Routing decisions",
        [target(rate("meshserve_scheduler_routed_total", "policy, reason"), "{{policy}} {{reason}}")],
        unit="reqps",
        stack=True,
    )
    g.panel(
        "Rejections / failovers / migrations",
        [
            target(rate("meshserve_scheduler_rejected_total", "code"), "rejected {{code}}"),
            target(rate("meshserve_scheduler_failovers_total", "outcome"), "failover {{outcome}}"),
            target(rate("meshserve_gateway_reroutes_total", "reason"), "gateway reroute {{reason}}"),
            target(rate("meshserve_gateway_migrations_total", "outcome"), "mid-stream migration {{outcome}}"),
            # Streams (re)opened to workers: bursts mean broken streams.
            target(rate("meshserve_gateway_worker_streams_opened_total"), "worker stream opened"),
        ],
        unit="reqps",
    )
    g.panel(
        "Leases (held, and how they end)",
        [
            target(gauge("meshserve_scheduler_leases"), "held"),
            target(rate("meshserve_scheduler_leases_ended_total", "how"), "ended {{how}}"),
        ],
    )
    prefix_cache_rows(g)


def prefix_cache_rows(g: Layout) -> None:
    """The scheduler's prefix index: its hits at routing, its predictions against the
    workers' caches."""
    g.panel(
        "Prefix hit ratio at routing",
        [target(mean("meshserve_scheduler_prefix_hit_ratio"), "mean")],
        unit="percentunit",
        max_value=1,
        description="Mean fraction of the prompt's full blocks already cached on the chosen worker.",
    )
    error = quantiles("meshserve_scheduler_cached_tokens_error", NS, (0.5, 0.01))
    g.panel(
        "Cached tokens per request: predicted vs actual",
        [
            target(mean("meshserve_scheduler_cached_tokens", "kind"), "{{kind}} (mean)"),
            *relabelled(error, "error {} (actual - predicted)"),
        ],
        description="The prefix index's prediction at routing time against the worker's usage "
        "(sent back on Release). Actual well below predicted = the index drifted from the caches.",
    )
    policy = quantiles("meshserve_scheduler_policy_seconds", NS, (0.5, 0.99))
    g.panel(
        "Cache predictions (index drift) / policy time",
        [
            target(rate("meshserve_scheduler_cache_predictions_total", "outcome"), "{{outcome}}"),
            *relabelled(policy, "policy {} (ms)", "1000 * {}"),
        ],
        description="Requests whose actual cached tokens were exact / below (over) / above (under) "
        "the prediction; and the routing policy's own time per decision.",
    )


def worker_rows(g: Layout) -> None:
    """Decoder workers, then the encoder cache."""
    g.row("Decoder workers")
    g.panel(
        "Running / waiting sequences",
        [
            target(gauge("meshserve_worker_num_running", "pod"), "running {{pod}}"),
            target(gauge("meshserve_worker_num_waiting", "pod"), "waiting {{pod}}"),
        ],
    )
    for title, metric in (
        ("KV-cache usage", "meshserve_worker_kv_usage"),
        ("Prefix-cache hit rate", "meshserve_worker_prefix_cache_hit_rate"),
    ):
        g.panel(title, [target(gauge(metric, "pod", "max"), "{{pod}}")], unit="percentunit", max_value=1)
    g.panel(
        "KV events to Redis",
        [
            target(rate("meshserve_worker_kv_events_published_total"), "published"),
            target(rate("meshserve_worker_kv_events_dropped_total"), "dropped"),
            target(rate("meshserve_worker_kv_resyncs_total"), "resyncs"),
        ],
        unit="ops",
        w=12,
    )
    g.panel(
        "Scheduler → KV events applied",
        [target(rate("meshserve_scheduler_kv_events_total", "result"), "{{result}}")],
        unit="ops",
        w=12,
    )

    g.row("Encoder cache")
    hits, misses = rate("meshserve_encoder_cache_hits_total"), rate("meshserve_encoder_cache_misses_total")
    g.panel(
        "Encoder-cache hit rate",
        [target(f"{hits} / ({hits} + {misses})", "hit rate")],
        unit="percentunit",
        max_value=1,
    )
    g.panel(
        "Encoder-cache size",
        [target(gauge("meshserve_encoder_cache_bytes", "pod"), "bytes {{pod}}")],
        unit="bytes",
    )
    g.panel(
        "Encoder-cache items / evictions",
        [
            target(gauge("meshserve_encoder_cache_items"), "items"),
            target(rate("meshserve_encoder_cache_evictions_total"), "evictions/s"),
        ],
    )


def transfer_and_rpc_rows(g: Layout) -> None:
    """The P/D KV hand-off, then every service's gRPC calls."""
    g.row("P/D disaggregation (KV hand-off)")
    g.panel(
        "KV hand-offs by outcome / fallbacks by reason",
        [
            target(rate("meshserve_worker_kv_transfers_total", "outcome"), "{{outcome}}"),
            target(rate("meshserve_worker_kv_transfer_fallbacks_total", "reason"), "fallback {{reason}}"),
        ],
        unit="ops",
    )
    g.panel(
        "KV transfer bytes",
        [target(rate("meshserve_worker_kv_transfer_bytes_total", "direction"), "{{direction}}")],
        unit="Bps",
    )
    g.panel(
        "KV hand-off p50 / p99 by phase",
        [
            target(
                f"histogram_quantile({q}, sum by (le, phase) "
                f"(rate(meshserve_worker_kv_transfer_seconds_bucket{{{NS}}}[{RATE}])))",
                f"p{int(q * 100)} {{{{phase}}}}",
            )
            for q in (0.5, 0.99)
        ],
        unit="s",
    )

    g.row("gRPC (every service)")
    g.panel(
        "gRPC calls by method and code",
        [target(rate("meshserve_rpc_requests_total", "method, code"), "{{method}} {{code}}")],
        unit="reqps",
        w=12,
    )
    p99 = f"histogram_quantile(0.99, sum by (le, method) (rate(meshserve_rpc_duration_seconds_bucket{{{NS}}}[{RATE}])))"
    g.panel("gRPC p99 duration by method", [target(p99, "{{method}}")], unit="s", w=12)


def label_variable(name: str, label: str, metric: str, ref_id: str) -> dict[str, Any]:
    """A dashboard variable over the values of `metric`'s label `name` (all by default)."""
    query = f"label_values({metric}, {name})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": ref_id},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
        "sort": 1,
        "hide": 0,
    }


def build() -> dict[str, Any]:
    g = Layout()
    gateway_row(g)
    flow_control_row(g)
    scheduler_row(g)
    worker_rows(g)
    transfer_and_rpc_rows(g)
    return {
        "title": "meshserve",
        "uid": "meshserve-overview",
        "description": "meshserve LLM mesh: gateway latency (TTFT/TPOT/ITL/E2E), scheduler, "
        "workers, encoder cache, gRPC. Metric reference: docs/metrics.md.",
        "tags": ["meshserve", "llm", "inference"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                label_variable("namespace", "Namespace", "meshserve_rpc_requests_total", "ns"),
                label_variable("route", "Route", "meshserve_gateway_requests_total", "route"),
            ]
        },
        "panels": g.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
