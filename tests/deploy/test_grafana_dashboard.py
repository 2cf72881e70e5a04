"""deploy/grafana/meshserve-dashboard.json: valid dashboard JSON, in sync with its generator,
querying only metrics the code defines."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "meshserve-dashboard.json"
SKIP_DIRS = {".venv", ".git", ".cache", "meshserve", "tests", "deploy", "node_modules"}
DEFINITION = re.compile(r"\b(Counter|Gauge|Histogram|Summary)\(\s*[\"'](meshserve_\w+)[\"']")


def code_metrics() -> dict[str, str]:
    """Exposed metric name → type, from every Counter/Gauge/Histogram(...) in the code."""
    found: dict[str, str] = {}
    for path in ROOT.rglob("*.py"):
        if SKIP_DIRS & set(path.relative_to(ROOT).parts[:-1]):
            continue
        for kind, name in DEFINITION.findall(path.read_text(errors="replace")):
            if kind == "Counter" and not name.endswith("_total"):
                name += "_total"
            found[name] = kind.lower()
    return found


def panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
    for panel in panels():
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["refId"]


def test_dashboard_is_generated_from_build_dashboard() -> None:
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render() == DASHBOARD.read_text(), "stale: run python deploy/grafana/build_dashboard.py"


def test_dashboard_queries_only_real_metrics() -> None:
    known = code_metrics()
    assert "meshserve_rpc_requests_total" in known and "meshserve_worker_kv_usage" in known
    used = set()
    for panel in panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for token in re.findall(r"\bmeshserve_\w+", expr):
                base = re.sub(r"_(bucket|sum|count)$", "", token)
                if base != token and known.get(base) == "histogram":
                    used.add(base)
                    continue
                assert token in known, f"{panel['title']}: {token} is not defined in the code"
                assert known[token] != "histogram", f"{panel['title']}: use {token}_bucket/_sum/_count"
                used.add(token)
            for bucket in re.findall(r"histogram_quantile\([^,]+,.*?\b(meshserve_\w+)", expr):
                assert bucket.endswith("_bucket"), expr
    for required in (
        "meshserve_gateway_requests_total",
        "meshserve_gateway_time_to_first_token_seconds",
        "meshserve_gateway_time_per_output_token_seconds",
        "meshserve_gateway_inter_token_latency_seconds",
        "meshserve_gateway_request_duration_seconds",
        "meshserve_scheduler_queue_depth",
        "meshserve_scheduler_workers",
        "meshserve_worker_num_running",
        "meshserve_worker_num_waiting",
        "meshserve_worker_kv_usage",
        "meshserve_worker_prefix_cache_hit_rate",
        "meshserve_encoder_cache_hits_total",
        "meshserve_encoder_cache_misses_total",
    ):
        assert required in used, f"the dashboard does not chart {required}"
