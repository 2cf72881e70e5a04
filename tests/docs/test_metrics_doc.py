"""docs/metrics.md documents exactly the metrics the services export: every
`meshserve_*` metric registered by a service module is in the doc's tables, and every
name in those tables is registered."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "scheduler_svc", "worker_svc", "tokenizer_svc", "encoder_cache_svc", "services")
# A module that constructs a metric: `Counter(`, `Gauge(` or `Histogram(` then, within the
# call, a "meshserve_..." name.
_DEFINES = re.compile(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*\"meshserve_", re.S)
_DOC_ROW = re.compile(r"^\|\s*`(meshserve_[a-z0-9_]+)`", re.M)


def _metric_modules() -> list[str]:
    modules = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if _DEFINES.search(path.read_text()):
                modules.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return modules


def _exported() -> set[str]:
    for module in _metric_modules():
        importlib.import_module(module)
    names = set()
    for family in REGISTRY.collect():
        if family.name.startswith("meshserve_"):
            names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_every_exported_metric_is_documented_and_every_documented_one_exported() -> None:
    documented = set(_DOC_ROW.findall((ROOT / "docs" / "metrics.md").read_text()))
    exported = _exported()
    assert len(exported) > 30, sorted(exported)  # the scan found the services' metrics
    assert exported - documented == set(), "exported but not in docs/metrics.md"
    assert documented - exported == set(), "in docs/metrics.md but not exported"
