"""deploy/pods.py: the rendered chart's pod specs as docker run arguments (what
`make deploy-check` starts): env as the kubelet builds it, probes, securityContext and
resources. No docker needed."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from deploy.chart import ROOT
from deploy.pods import (
    PodFacts,
    PodPlan,
    container_args,
    expand,
    pause_args,
    plan_pods,
    quantity,
    resolve_env,
)
from tests.deploy.conftest import Rendered

CHECK_VALUES = yaml.safe_load(
    (ROOT / "deploy" / "helm" / "examples" / "deploy-check-values.yaml").read_text()
)


@pytest.fixture(scope="module")
def check_render(render: Callable[..., Rendered]) -> Rendered:
    return render(CHECK_VALUES)


def pod(plans: list[PodPlan], component: str) -> PodPlan:
    return next(p for p in plans if p.component == component)


def flags(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


def test_every_deployment_becomes_its_replicas(check_render: Rendered) -> None:
    plans = plan_pods(check_render)
    by_component: dict[str, list[str]] = {}
    for plan in plans:
        by_component.setdefault(plan.component, []).append(plan.name)
    assert set(by_component) == set(check_render.by_component("Deployment"))
    assert by_component["decoder"] == ["ms-meshserve-decoder-0", "ms-meshserve-decoder-1"]
    assert len(by_component["gateway"]) == 1
    # Each pod answers to the names of the Services that select it (headless ones included).
    assert pod(plans, "decoder").aliases == ["ms-meshserve-decoder"]
    assert pod(plans, "scheduler").aliases == ["ms-meshserve-scheduler"]


def test_the_hpa_min_replicas_stand_in_for_replicas(render: Callable[..., Rendered]) -> None:
    plans = plan_pods(
        render({"gateway": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 5}}})
    )
    assert sum(p.component == "gateway" for p in plans) == 3


def test_env_is_built_as_the_kubelet_builds_it(render: Callable[..., Rendered]) -> None:
    r = render({**CHECK_VALUES, "apiKeys": {"keys": ["k1", "k2"]}})
    plans = plan_pods(r)
    decoder = pod(plans, "decoder")
    env = resolve_env(decoder, PodFacts("ms-meshserve-decoder-0", "llm", "10.1.2.3", node_cpus=16), r)
    assert env["POD_IP"] == "10.1.2.3" and env["POD_NAME"] == "ms-meshserve-decoder-0"
    assert env["MESHSERVE_ADVERTISE_ADDRESS"] == "10.1.2.3:50061"  # $(POD_IP) expanded
    assert env["MESHSERVE_WORKER_ID"] == "ms-meshserve-decoder-0"
    assert env["MESHSERVE_REDIS_URL"] == "redis://ms-meshserve-redis:6379/0"  # ConfigMap key
    assert env["MESHSERVE_NUM_THREADS"] == "1"  # limits.cpu through resourceFieldRef
    assert list(env) == [e["name"] for e in decoder.env]
    gateway = pod(plans, "gateway")
    assert (
        resolve_env(gateway, PodFacts("g", "llm", "10.1.2.4", 16), r)["MESHSERVE_API_KEYS"] == "k1,k2"
    )  # Secret


def test_resource_field_ref_rounds_up_and_defaults_to_the_node(render: Callable[..., Rendered]) -> None:
    values = copy.deepcopy(CHECK_VALUES)
    values["decoder"]["resources"]["limits"]["cpu"] = "1500m"
    decoder = pod(plan_pods(render(values)), "decoder")
    assert (
        resolve_env(decoder, PodFacts("d", "llm", "10.0.0.1", 16), render(values))["MESHSERVE_NUM_THREADS"]
        == "2"
    )
    values["decoder"]["resources"]["limits"]["cpu"] = None  # null deletes the default in Helm
    decoder = pod(plan_pods(render(values)), "decoder")
    assert (
        resolve_env(decoder, PodFacts("d", "llm", "10.0.0.1", 16), render(values))["MESHSERVE_NUM_THREADS"]
        == "16"
    )


def test_expansion_follows_kubernetes() -> None:
    env = {"A": "x"}
    assert expand("$(A):$(B):$$(A)", env) == "x:$(B):$(A)"
    assert [quantity(q) for q in ("500m", "2", "1Gi", "128Mi", 0.5)] == [0.5, 2.0, 2.0**30, 2.0**27, 0.5]
    with pytest.raises(ValueError, match="quantity"):
        quantity("2 cores")


def test_probes_are_the_charts(check_render: Rendered) -> None:
    plans = plan_pods(check_render)
    decoder = pod(plans, "decoder").probes
    assert decoder["startupProbe"].kind == "grpc" and decoder["startupProbe"].port == 50061
    assert decoder["startupProbe"].period_s == CHECK_VALUES["decoder"]["startupProbe"]["periodSeconds"]
    assert decoder["readinessProbe"].kind == decoder["livenessProbe"].kind == "grpc"
    gateway = pod(plans, "gateway").probes
    assert (
        gateway["readinessProbe"].kind,
        gateway["readinessProbe"].path,
        gateway["readinessProbe"].port,
    ) == (
        "http",
        "/health",
        8000,
    )
    assert gateway["livenessProbe"].kind == "tcp" and gateway["livenessProbe"].port == 8000
    redis = pod(plans, "redis").probes
    assert redis["readinessProbe"].command == ("redis-cli", "ping")
    assert redis["livenessProbe"].kind == "tcp" and redis["livenessProbe"].port == 6379


def test_security_context_and_resources_become_docker_flags(check_render: Rendered) -> None:
    decoder = pod(plan_pods(check_render), "decoder")
    env = {"MESHSERVE_PORT": "50061"}
    args = container_args(decoder, env, {"l": "1"})
    values = CHECK_VALUES["decoder"]["resources"]
    assert flags(args, "--user") == ["10001:10001"] and flags(args, "--group-add") == ["10001"]
    assert "--read-only" in args and flags(args, "--cap-drop") == ["ALL"]
    assert flags(args, "--security-opt") == ["no-new-privileges"]
    assert flags(args, "--memory") == [str(int(quantity(values["limits"]["memory"])))]
    assert flags(args, "--cpus") == ["1"] and flags(args, "--cpu-shares") == ["1024"]
    assert flags(args, "--tmpfs") == [
        "/tmp:rw,exec,nosuid,nodev,mode=1777,uid=10001,gid=10001",
        "/home/meshserve/.cache:rw,exec,nosuid,nodev,mode=1777,uid=10001,gid=10001",
    ]
    assert flags(args, "--shm-size") == [str(int(quantity(CHECK_VALUES["decoder"]["shmSize"])))]
    assert flags(args, "--network") == ["container:ms-meshserve-decoder-0-pause"]
    assert flags(args, "--env") == ["MESHSERVE_PORT=50061"]
    # command replaces the entrypoint, the rest follows the image name.
    assert flags(args, "--entrypoint") == ["python"] and args[-3:] == ["meshserve:0.1.0", "-m", "worker_svc"]
    pause = pause_args(decoder, "net", "pause:1", {})
    assert flags(pause, "--network-alias") == ["ms-meshserve-decoder"]
    assert flags(pause, "--hostname") == ["ms-meshserve-decoder-0"] and pause[-2:] == ["pause:1", "-P"]


def test_redis_command_and_args_reach_docker(check_render: Rendered) -> None:
    redis = pod(plan_pods(check_render), "redis")
    args = container_args(redis, {}, {})
    assert flags(args, "--user") == ["999:999"]
    image = "meshserve-redis:7.0-bookworm"
    assert args[args.index(image) :] == [image, *CHECK_VALUES["redis"]["args"]]
    assert flags(args, "--entrypoint") == ["redis-server"]


@pytest.mark.parametrize(
    "override, error",
    [
        ({"podSecurityContext": {"runAsNonRoot": True, "runAsUser": 0}}, "runAsNonRoot"),
        ({"podSecurityContext": {"runAsUser": None}}, "runAsUser unset"),
        ({"model": {"volume": {"persistentVolumeClaim": {"claimName": "m"}}}}, "only emptyDir"),
    ],
    ids=["root", "no-uid", "pvc"],
)
def test_what_cannot_be_run_faithfully_is_refused(
    render: Callable[..., Rendered], override: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        plan_pods(render({**CHECK_VALUES, **override}))
