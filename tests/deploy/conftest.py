"""Fixtures rendering the Helm chart with deploy/chart.py (helm-python-sdk in-process: no
helm binary, no cluster, no network)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from deploy.chart import CHART, NAMESPACE, RELEASE, ROOT, Manifest, Rendered, load_helm

__all__ = ["CHART", "GPU_VALUES", "Manifest", "Rendered"]

GPU_VALUES = ROOT / "deploy" / "helm" / "examples" / "gpu-values.yaml"


def _load_helm() -> Any:
    try:
        return load_helm()
    except ImportError:
        pytest.skip(
            "Helm renderer missing: helm-python-sdk is not installed "
            "(pip install -r requirements-dev.txt, which pins it)"
        )
    except RuntimeError as exc:
        pytest.skip(f"Helm renderer unusable: {exc}")


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
