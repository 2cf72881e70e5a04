"""E/PD disaggregation in the chart and the launcher agree: with encoder workers enabled
(chart `encoder.enabled`, launcher `num_encoders`), both start the encoder cache and the
encoder workers on the same ports and point the scheduler, decoders and encoders at the
encoder cache (MESHSERVE_ENCODER_CACHE_ADDRESS, a real config field of each)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from launcher import mesh as launcher
from services.config import DEFAULT_PORTS
from tests.deploy.conftest import Rendered
from tests.deploy.test_helm_chart import COMPONENTS, config_fields, env_of, main_port, meshserve_deployments

CACHE_ENV = "MESHSERVE_ENCODER_CACHE_ADDRESS"


@pytest.fixture(scope="module")
def encoder_render(render: Callable[..., Rendered]) -> Rendered:
    return render({"encoder": {"enabled": True}})


@pytest.fixture(scope="module")
def encoder_launcher_specs() -> dict[str, Any]:
    config = launcher.MeshConfig(model_dir="/models/vlm", embedding_model_dir="", num_encoders=2)
    specs: dict[str, Any] = {}
    for spec in launcher.service_specs(config, "redis://127.0.0.1:6379/0"):
        specs.setdefault(re.sub(r"-\d+$", "", spec.name), spec)
    return specs


def test_launcher_starts_the_encoder_cache_and_encoders(encoder_launcher_specs: dict[str, Any]) -> None:
    assert encoder_launcher_specs["encoder-cache"].module == "encoder_cache_svc"
    assert encoder_launcher_specs["encoder"].port == DEFAULT_PORTS["encoder"] == 50091
    assert encoder_launcher_specs["encoder"].env["MESHSERVE_ROLE"] == "encoder"
    no_encoders = launcher.service_specs(launcher.MeshConfig(model_dir="/m", embedding_model_dir=""), "")
    assert not [s for s in no_encoders if s.name.startswith("encoder") or CACHE_ENV in s.env]


def test_chart_matches_the_launcher_with_encoders(
    encoder_render: Rendered, encoder_launcher_specs: dict[str, Any]
) -> None:
    deployments = meshserve_deployments(encoder_render)
    cache_port = encoder_launcher_specs["encoder-cache"].port
    for component in ("encoder-cache", "encoder"):
        assert main_port(deployments[component]) == encoder_launcher_specs[component].port, component
    for component in ("scheduler", "decoder", "encoder"):
        launcher_value = encoder_launcher_specs[component].env[CACHE_ENV]
        chart_value = env_of(deployments[component])[CACHE_ENV]["value"]
        assert launcher_value.endswith(f":{cache_port}") and chart_value.endswith(f":{cache_port}"), component
        assert CACHE_ENV in config_fields(COMPONENTS[component][1]), component
    for component, spec in encoder_launcher_specs.items():
        if component in deployments:
            missing = sorted(set(spec.env) - set(env_of(deployments[component])))
            assert not missing, f"{component}: the launcher passes {missing}; add them to templates/_env.tpl"


def test_scheduler_gets_no_cache_address_without_encoders(default_render: Rendered) -> None:
    assert CACHE_ENV not in env_of(meshserve_deployments(default_render)["scheduler"])
