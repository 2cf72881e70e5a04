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


def build() -> dict[str, Any]:
    g = Layout()

    g.row("Gateway")
    g.panel(
        "Request rate by status",
        [
            {
                "expr": f'sum by (status) (rate(meshserve_gateway_requests_total{{{NS}, route=~"$route"}}[{RATE}]))',
                "legendFormat": "{{status}}",
            }
        ],
        unit="reqps",
        stack=True,
        description="HTTP requests answered per second, by status code (route filter above).",
    )
    g.panel(
        "Error ratio (5xx)",
        [
            {
                "expr": f'sum(rate(meshserve_gateway_requests_total{{{NS}, route=~"$route", status=~"5.."}}[{RATE}]))'
                f' / sum(rate(meshserve_gateway_requests_total{{{NS}, route=~"$route"}}[{RATE}]))',
                "legendFormat": "5xx / all",
            }
        ],
        unit="percentunit",
    )
    g.panel(
        "Requests in flight / token throughput",
        [
            {
                "expr": f"sum by (route) (meshserve_gateway_requests_in_flight{{{NS}}})",
                "legendFormat": "in flight {{route}}",
            },
            {
                "expr": f"sum(rate(meshserve_gateway_prompt_tokens_total{{{NS}}}[{RATE}]))",
                "legendFormat": "prompt tokens/s",
            },
            {
                "expr": f"sum(rate(meshserve_gateway_completion_tokens_total{{{NS}}}[{RATE}]))",
                "legendFormat": "completion tokens/s",
            },
        ],
    )
    sel = f"{NS}, {GEN_ROUTES}"
    g.panel(
        "Time to first token (TTFT)",
        quantiles("meshserve_gateway_time_to_first_token_seconds", sel),
        unit="s",
        w=6,
    )
    g.panel(
        "Time per output token (TPOT)",
        quantiles("meshserve_gateway_time_per_output_token_seconds", sel),
        unit="s",
        w=6,
    )
    g.panel(
        "Inter-token latency (ITL)",
        quantiles("meshserve_gateway_inter_token_latency_seconds", sel),
        unit="s",
        w=6,
    )
    g.panel(
        "End-to-end latency (E2E)",
        quantiles("meshserve_gateway_request_duration_seconds", f'{NS}, route=~"$route"'),
        unit="s",
        w=6,
    )

    g.row("Scheduler")
    g.panel(
        "Admission queue",
        [
            {"expr": f"sum(meshserve_scheduler_queue_depth{{{NS}}})", "legendFormat": "queued"},
            {
                "expr": f"sum by (worker_id) (meshserve_scheduler_worker_inflight{{{NS}}})",
                "legendFormat": "in flight {{worker_id}}",
            },
        ],
        description="Requests waiting for a worker slot, and requests in flight per worker.",
    )
    g.panel(
        "Worker health",
        [
            {
                "expr": f"max by (role, health) (meshserve_scheduler_workers{{{NS}}})",
                "legendFormat": "{{role}} {{health}}",
            }
        ],
        description="Workers registered with the scheduler, by role and health.",
        stack=True,
    )
    g.panel(
        "Workers healthy",
        [
            {
                "expr": f'max by (role) (meshserve_scheduler_workers{{{NS}, health="healthy"}})',
                "legendFormat": "{{role}}",
            }
        ],
        kind="stat",
        w=4,
    )
    g.panel(
        "Redis reachable",
        [{"expr": f"min(meshserve_scheduler_redis_up{{{NS}}})", "legendFormat": "redis"}],
        kind="stat",
        w=4,
    )
    g.panel(
        "Scheduling overhead / queue wait",
        [
            *quantiles("meshserve_scheduler_overhead_seconds", NS, (0.5, 0.99)),
            *[
                {**t, "legendFormat": "queue wait " + t["legendFormat"]}
                for t in quantiles("meshserve_scheduler_queue_wait_seconds", NS, (0.5, 0.99))
            ],
        ],
        unit="s",
    )
    g.panel(
        "Routing decisions",
        [
            {
                "expr": f"sum by (policy, reason) (rate(meshserve_scheduler_routed_total{{{NS}}}[{RATE}]))",
                "legendFormat": "{{policy}} {{reason}}",
            }
        ],
        unit="reqps",
        stack=True,
    )
    g.panel(
        "Rejections / failovers / migrations",
        [
            {
                "expr": f"sum by (code) (rate(meshserve_scheduler_rejected_total{{{NS}}}[{RATE}]))",
                "legendFormat": "rejected {{code}}",
            },
            {
                "expr": f"sum by (outcome) (rate(meshserve_scheduler_failovers_total{{{NS}}}[{RATE}]))",
                "legendFormat": "failover {{outcome}}",
            },
            {
                "expr": f"sum by (reason) (rate(meshserve_gateway_reroutes_total{{{NS}}}[{RATE}]))",
                "legendFormat": "gateway reroute {{reason}}",
            },
            {
                "expr": f"sum by (outcome) (rate(meshserve_gateway_migrations_total{{{NS}}}[{RATE}]))",
                "legendFormat": "mid-stream migration {{outcome}}",
            },
            {
                # Streams (re)opened to workers: bursts mean broken streams.
                "expr": f"sum(rate(meshserve_gateway_worker_streams_opened_total{{{NS}}}[{RATE}]))",
                "legendFormat": "worker stream opened",
            },
        ],
        unit="reqps",
    )
    g.panel(
        "Leases (held, and how they end)",
        [
            {"expr": f"sum(meshserve_scheduler_leases{{{NS}}})", "legendFormat": "held"},
            {
                "expr": f"sum by (how) (rate(meshserve_scheduler_leases_ended_total{{{NS}}}[{RATE}]))",
                "legendFormat": "ended {{how}}",
            },
        ],
    )
    g.panel(
        "Prefix hit ratio at routing",
        [
            {
                "expr": f"sum(rate(meshserve_scheduler_prefix_hit_ratio_sum{{{NS}}}[{RATE}]))"
                f" / sum(rate(meshserve_scheduler_prefix_hit_ratio_count{{{NS}}}[{RATE}]))",
                "legendFormat": "mean",
            }
        ],
        unit="percentunit",
        max_value=1,
        description="Mean fraction of the prompt's full blocks already cached on the chosen worker.",
    )
    g.panel(
        "Cached tokens per request: predicted vs actual",
        [
            {
                "expr": f"sum by (kind) (rate(meshserve_scheduler_cached_tokens_sum{{{NS}}}[{RATE}]))"
                f" / sum by (kind) (rate(meshserve_scheduler_cached_tokens_count{{{NS}}}[{RATE}]))",
                "legendFormat": "{{kind}} (mean)",
            },
            *[
                {**t, "legendFormat": f"error {t['legendFormat']} (actual - predicted)"}
                for t in quantiles("meshserve_scheduler_cached_tokens_error", NS, (0.5, 0.01))
            ],
        ],
        description="The prefix index's prediction at routing time against the worker's usage "
        "(sent back on Release). Actual well below predicted = the index drifted from the caches.",
    )
    g.panel(
        "Cache predictions (index drift) / policy time",
        [
            {
                "expr": f"sum by (outcome) (rate(meshserve_scheduler_cache_predictions_total{{{NS}}}[{RATE}]))",
                "legendFormat": "{{outcome}}",
            },
            *[
                {**t, "legendFormat": f"policy {t['legendFormat']} (ms)", "expr": f"1000 * {t['expr']}"}
                for t in quantiles("meshserve_scheduler_policy_seconds", NS, (0.5, 0.99))
            ],
        ],
        description="Requests whose actual cached tokens were exact / below (over) / above (under) "
        "the prediction; and the routing policy's own time per decision.",
    )

    g.row("Decoder workers")
    g.panel(
        "Running / waiting sequences",
        [
            {
                "expr": f"sum by (pod) (meshserve_worker_num_running{{{NS}}})",
                "legendFormat": "running {{pod}}",
            },
            {
                "expr": f"sum by (pod) (meshserve_worker_num_waiting{{{NS}}})",
                "legendFormat": "waiting {{pod}}",
            },
        ],
    )
    g.panel(
        "KV-cache usage",
        [{"expr": f"max by (pod) (meshserve_worker_kv_usage{{{NS}}})", "legendFormat": "{{pod}}"}],
        unit="percentunit",
        max_value=1,
    )
    g.panel(
        "Prefix-cache hit rate",
        [
            {
                "expr": f"max by (pod) (meshserve_worker_prefix_cache_hit_rate{{{NS}}})",
                "legendFormat": "{{pod}}",
            }
        ],
        unit="percentunit",
        max_value=1,
    )
    g.panel(
        "KV events to Redis",
        [
            {
                "expr": f"sum(rate(meshserve_worker_kv_events_published_total{{{NS}}}[{RATE}]))",
                "legendFormat": "published",
            },
            {
                "expr": f"sum(rate(meshserve_worker_kv_events_dropped_total{{{NS}}}[{RATE}]))",
                "legendFormat": "dropped",
            },
            {
                "expr": f"sum(rate(meshserve_worker_kv_resyncs_total{{{NS}}}[{RATE}]))",
                "legendFormat": "resyncs",
            },
        ],
        unit="ops",
        w=12,
    )
    g.panel(
        "Scheduler → KV events applied",
        [
            {
                "expr": f"sum by (result) (rate(meshserve_scheduler_kv_events_total{{{NS}}}[{RATE}]))",
                "legendFormat": "{{result}}",
            }
        ],
        unit="ops",
        w=12,
    )

    g.row("Encoder cache")
    hits = f"sum(rate(meshserve_encoder_cache_hits_total{{{NS}}}[{RATE}]))"
    misses = f"sum(rate(meshserve_encoder_cache_misses_total{{{NS}}}[{RATE}]))"
    g.panel(
        "Encoder-cache hit rate",
        [{"expr": f"{hits} / ({hits} + {misses})", "legendFormat": "hit rate"}],
        unit="percentunit",
        max_value=1,
    )
    g.panel(
        "Encoder-cache size",
        [
            {
                "expr": f"sum by (pod) (meshserve_encoder_cache_bytes{{{NS}}})",
                "legendFormat": "bytes {{pod}}",
            },
        ],
        unit="bytes",
    )
    g.panel(
        "Encoder-cache items / evictions",
        [
            {"expr": f"sum(meshserve_encoder_cache_items{{{NS}}})", "legendFormat": "items"},
            {
                "expr": f"sum(rate(meshserve_encoder_cache_evictions_total{{{NS}}}[{RATE}]))",
                "legendFormat": "evictions/s",
            },
        ],
    )

    g.row("P/D disaggregation (KV hand-off)")
    g.panel(
        "KV hand-offs by outcome / fallbacks by reason",
        [
            {
                "expr": f"sum by (outcome) (rate(meshserve_worker_kv_transfers_total{{{NS}}}[{RATE}]))",
                "legendFormat": "{{outcome}}",
            },
            {
                "expr": f"sum by (reason) (rate(meshserve_worker_kv_transfer_fallbacks_total{{{NS}}}[{RATE}]))",
                "legendFormat": "fallback {{reason}}",
            },
        ],
        unit="ops",
    )
    g.panel(
        "KV transfer bytes",
        [
            {
                "expr": f"sum by (direction) (rate(meshserve_worker_kv_transfer_bytes_total{{{NS}}}[{RATE}]))",
                "legendFormat": "{{direction}}",
            }
        ],
        unit="Bps",
    )
    g.panel(
        "KV hand-off p50 / p99 by phase",
        [
            {
                "expr": f"histogram_quantile({q}, sum by (le, phase) "
                f"(rate(meshserve_worker_kv_transfer_seconds_bucket{{{NS}}}[{RATE}])))",
                "legendFormat": f"p{int(q * 100)} {{{{phase}}}}",
            }
            for q in (0.5, 0.99)
        ],
        unit="s",
    )

    g.row("gRPC (every service)")
    g.panel(
        "gRPC calls by method and code",
        [
            {
                "expr": f"sum by (method, code) (rate(meshserve_rpc_requests_total{{{NS}}}[{RATE}]))",
                "legendFormat": "{{method}} {{code}}",
            }
        ],
        unit="reqps",
        w=12,
    )
    g.panel(
        "gRPC p99 duration by method",
        [
            {
                "expr": "histogram_quantile(0.99, sum by (le, method) "
                f"(rate(meshserve_rpc_duration_seconds_bucket{{{NS}}}[{RATE}])))",
                "legendFormat": "{{method}}",
            }
        ],
        unit="s",
        w=12,
    )

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
                {
                    "name": "namespace",
                    "label": "Namespace",
                    "type": "query",
                    "datasource": DS,
                    "query": {
                        "query": "label_values(meshserve_rpc_requests_total, namespace)",
                        "refId": "ns",
                    },
                    "definition": "label_values(meshserve_rpc_requests_total, namespace)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "sort": 1,
                    "hide": 0,
                },
                {
                    "name": "route",
                    "label": "Route",
                    "type": "query",
                    "datasource": DS,
                    "query": {
                        "query": "label_values(meshserve_gateway_requests_total, route)",
                        "refId": "route",
                    },
                    "definition": "label_values(meshserve_gateway_requests_total, route)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "sort": 1,
                    "hide": 0,
                },
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
