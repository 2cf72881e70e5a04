"""Renders the Helm chart in-process with helm-python-sdk (Helm's Go SDK behind ctypes,
pinned in requirements-dev.txt): no helm binary, no cluster, no network."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "meshserve"
GPU_VALUES = ROOT / "deploy" / "helm" / "examples" / "gpu-values.yaml"
RELEASE = "ms"
NAMESPACE = "llm"

Manifest = dict[str, Any]
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Rendered:
    """The manifests of one `helm template` run, indexed for the tests."""

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


def _load_helm() -> Any:
    try:
        import helm_python
    except ImportError:
        pytest.skip(
            "Helm renderer missing: helm-python-sdk is not installed "
            "(pip install -r requirements-dev.txt, which pins it)"
        )
    try:
        helm_python.helm_sdk_version()
    except Exception as exc:  # native library missing or not loadable on this platform
        pytest.skip(f"Helm renderer unusable: helm-python-sdk's native libhelm_c failed to load: {exc}")
    return helm_python


@pytest.fixture(scope="session")
def helm() -> Any:
    return _load_helm()


@pytest.fixture(scope="session")
def gpu_values() -> dict[str, Any]:
    return yaml.safe_load(GPU_VALUES.read_text())


@pytest.fixture(scope="session")
def render(helm: Any) -> Iterator[Callable[..., Rendered]]:
    """render(values=None, release=RELEASE) → Rendered, on a chart loaded once."""
    chart = helm.Chart.load(str(CHART))
    cache: dict[str, Rendered] = {}

    def _render(values: dict[str, Any] | None = None, release: str = RELEASE) -> Rendered:
        key = repr((values, release))
        if key not in cache:
            files = chart.render(copy.deepcopy(values or {}), name=release, namespace=NAMESPACE)
            cache[key] = Rendered(files)
        return cache[key]

    yield _render
    chart.close()


@pytest.fixture(scope="session")
def default_render(render: Callable[..., Rendered]) -> Rendered:
    return render()


@pytest.fixture(scope="session")
def gpu_render(render: Callable[..., Rendered], gpu_values: dict[str, Any]) -> Rendered:
    return render(gpu_values)
