"""Renders the Helm chart in-process with helm-python-sdk (Helm's Go SDK behind ctypes,
pinned in requirements-dev.txt): no helm binary, no cluster, no network. Used by the chart
tests (tests/deploy) and by `make deploy-check` (deploy/check.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "meshserve"
RELEASE = "ms"
NAMESPACE = "llm"

Manifest = dict[str, Any]
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Rendered:
    """The manifests of one `helm template` run, indexed by kind, name and component."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.docs: list[Manifest] = []
        for path, text in sorted(files.items()):
            if not path.endswith((".yaml", ".yml")):
                continue
            for doc in yaml.load_all(text, Loader=_LOADER):
                if doc is not None:
                    doc.setdefault("__source__", path)
                    self.docs.append(doc)

    def of_kind(self, kind: str) -> list[Manifest]:
        return [d for d in self.docs if d.get("kind") == kind]

    def get(self, kind: str, name: str) -> Manifest | None:
        return next((d for d in self.of_kind(kind) if d["metadata"]["name"] == name), None)

    def by_component(self, kind: str) -> dict[str, Manifest]:
        """Objects of `kind` keyed by their app.kubernetes.io/component label."""
        out = {}
        for d in self.of_kind(kind):
            component = d["metadata"].get("labels", {}).get("app.kubernetes.io/component")
            if component:
                assert component not in out, f"two {kind}s for component {component}"
                out[component] = d
        return out


def load_helm() -> Any:
    """The helm_python module, or ImportError/RuntimeError saying why it cannot render."""
    import helm_python

    try:
        helm_python.helm_sdk_version()
    except Exception as exc:  # native library missing or not loadable on this platform
        raise RuntimeError(f"helm-python-sdk's native libhelm_c failed to load: {exc}") from exc
    return helm_python


def render(
    values: dict[str, Any] | None = None, release: str = RELEASE, namespace: str = NAMESPACE, helm: Any = None
) -> Rendered:
    """`helm template RELEASE deploy/helm/meshserve -n NAMESPACE -f values` in-process."""
    helm = helm or load_helm()
    chart = helm.Chart.load(str(CHART))
    try:
        return Rendered(chart.render(copy.deepcopy(values or {}), name=release, namespace=namespace))
    finally:
        chart.close()
