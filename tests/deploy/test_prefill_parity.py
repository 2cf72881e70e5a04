"""P/D disaggregation in the chart and the launcher agree: with prefill workers (chart
`prefill.enabled`, launcher `num_prefill`), both start them in role "prefill" on the same
port with the decoder's engine settings, as their own Deployment with its own replicas,
resources and HPA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from launcher import mesh as launcher
from services.config import DEFAULT_PORTS
from tests.deploy.conftest import Rendered
from tests.deploy.test_helm_chart import env_of, main_port, meshserve_deployments

ENGINE_ENV = (
    "MESHSERVE_KV_CACHE_MEMORY_MB",
    "MESHSERVE_MAX_NUM_SEQS",
    "MESHSERVE_MODEL_DIR",
    "MESHSERVE_BLOCK_SIZE",
)


@pytest.fixture(scope="module")
def prefill_render(render: Callable[..., Rendered]) -> Rendered:
    return render(
        {
            "prefill": {
                "enabled": True,
                "replicas": 3,
                "resources": {"requests": {"cpu": "6"}},
                "autoscaling": {"enabled": True, "maxReplicas": 7},
            }
        }
    )


def test_launcher_starts_prefill_workers() -> None:
    config = launcher.MeshConfig(model_dir="/m", embedding_model_dir="", num_prefill=2)
    specs = {s.name: s for s in launcher.service_specs(config, "redis://127.0.0.1:6379/0")}
    assert specs["prefill-0"].port == DEFAULT_PORTS["prefill"] == 50101
    assert specs["prefill-1"].port == 50102
    assert specs["prefill-1"].env["MESHSERVE_ROLE"] == "prefill"
    assert specs["prefill-1"].env["MESHSERVE_WORKER_ID"] == "prefill-1"
    for name in ("MESHSERVE_KV_CACHE_MEMORY_MB", "MESHSERVE_MAX_NUM_SEQS", "MESHSERVE_MODEL_DIR"):
        assert specs["prefill-0"].env[name] == specs["decoder-0"].env[name], name
    none = launcher.service_specs(launcher.MeshConfig(model_dir="/m", embedding_model_dir=""), "")
    assert not [s for s in none if s.name.startswith("prefill")]
    with pytest.raises(ValueError, match="num_prefill"):
        launcher.MeshConfig(model_dir="/m", num_prefill=-1)


def test_chart_prefill_deployment_matches_the_launcher(prefill_render: Rendered) -> None:
    deployments = meshserve_deployments(prefill_render)
    prefill, decoder = deployments["prefill"], deployments["decoder"]
    assert main_port(prefill) == DEFAULT_PORTS["prefill"]
    env = env_of(prefill)
    assert env["MESHSERVE_ROLE"]["value"] == "prefill"
    for name in ENGINE_ENV:
        assert env[name] == env_of(decoder)[name], name
    assert "replicas" not in prefill["spec"], "the HPA owns the replica count"
    container: dict[str, Any] = prefill["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"] == "6"
    hpas = prefill_render.by_component("HorizontalPodAutoscaler")
    assert hpas["prefill"]["spec"]["maxReplicas"] == 7
    assert "decoder" not in hpas, "the decoders scale on their own"


def test_chart_prefill_replicas_apart_from_the_decoders(render: Callable[..., Rendered]) -> None:
    rendered = render({"prefill": {"enabled": True, "replicas": 3}, "decoder": {"replicas": 2}})
    deployments = meshserve_deployments(rendered)
    assert deployments["prefill"]["spec"]["replicas"] == 3
    assert deployments["decoder"]["spec"]["replicas"] == 2


def test_no_prefill_deployment_by_default(default_render: Rendered) -> None:
    assert "prefill" not in meshserve_deployments(default_render)
