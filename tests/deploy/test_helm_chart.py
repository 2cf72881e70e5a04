"""The Helm chart (deploy/helm/meshserve) rendered with its default values and with the GPU
example: well-formed objects, the expected Deployments/Services/HPAs/PDBs, gRPC probes,
and agreement with the local launcher (launcher/mesh.py: service list, ports, env names)
and with the services' config dataclasses (every MESHSERVE_* name is a real field)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

import launcher.mesh as launcher_mesh
from services import config
from tests.deploy.conftest import CHART, GPU_VALUES, Manifest, Rendered

# component → (python -m module, config module)
COMPONENTS = {
    "gateway": ("gateway", "gateway.config"),
    "tokenizer": ("tokenizer_svc", "tokenizer_svc.config"),
    "scheduler": ("scheduler_svc", "scheduler_svc.config"),
    "encoder-cache": ("encoder_cache_svc", "encoder_cache_svc.config"),
    "decoder": ("worker_svc", "worker_svc.config"),
    "embedding": ("worker_svc", "worker_svc.config"),
    "encoder": ("worker_svc", "worker_svc.config"),
    "prefill": ("worker_svc", "worker_svc.config"),
}
WORKERS = {"decoder", "embedding", "encoder", "prefill"}
GRPC = set(COMPONENTS) - {"gateway"}
DEFAULT_ON = {"gateway", "tokenizer", "scheduler", "encoder-cache", "decoder", "embedding"}
# Components the chart deploys that the local launcher does not start (yet).
CHART_ONLY = {"encoder-cache", "encoder"}
# Env the chart passes ahead of the config field that will read it (ignored until then).
PENDING_ENV = {
    "decoder": {"MESHSERVE_ENCODER_CACHE_ADDRESS"},
    "encoder": {"MESHSERVE_ENCODER_CACHE_ADDRESS"},
}


def container(deployment: Manifest) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, deployment["metadata"]["name"]
    return containers[0]


def env_of(deployment: Manifest) -> dict[str, dict[str, Any]]:
    entries = container(deployment).get("env", [])
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), f"duplicate env in {deployment['metadata']['name']}: {names}"
    return {e["name"]: e for e in entries}


def meshserve_deployments(rendered: Rendered) -> dict[str, Manifest]:
    return {c: d for c, d in rendered.by_component("Deployment").items() if c in COMPONENTS}


def main_port(deployment: Manifest) -> int:
    ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
    return ports.get("grpc", ports.get("http"))


@pytest.fixture(scope="session")
def launcher() -> Any:
    # A plain import: an ImportError in the launcher must fail these tests, not skip them.
    return launcher_mesh


@pytest.fixture(scope="session")
def launcher_specs(launcher: Any) -> dict[str, Any]:
    """The launcher's services by component, first instance of each (decoder-0, ...)."""
    config = launcher.MeshConfig(model_dir="/models/llm", embedding_model_dir="/models/emb", num_decoders=2)
    specs: dict[str, Any] = {}
    for spec in launcher.service_specs(config, "redis://127.0.0.1:6379/0"):
        specs.setdefault(re.sub(r"-\d+$", "", spec.name), spec)
    return specs


def config_classes(module_name: str) -> list[type[Any]]:
    """The config dataclasses a service's config module defines."""
    module = importlib.import_module(module_name)
    found = [
        cls
        for _, cls in inspect.getmembers(module, dataclasses.is_dataclass)
        if inspect.isclass(cls) and cls.__module__ == module.__name__
    ]
    assert found, f"no config dataclass in {module_name}"
    return found


def config_fields(module_name: str) -> set[str]:
    """MESHSERVE_* names a service's config reads (a nested config's options included)."""
    return set().union(*(config.env_names(cls) for cls in config_classes(module_name)))


@pytest.fixture(scope="session", params=["default", "gpu"])
def any_render(request: pytest.FixtureRequest) -> Rendered:
    return request.getfixturevalue(f"{request.param}_render")


# ---------------------------------------------------------------------------- chart health


@pytest.mark.parametrize("values_file", [None, GPU_VALUES], ids=["default", "gpu"])
def test_helm_lint_strict_is_clean(helm: Any, values_file: Any) -> None:
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    report = helm.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_every_manifest_is_well_formed(any_render: Rendered) -> None:
    assert any_render.docs
    seen = set()
    for doc in any_render.docs:
        where = doc["__source__"]
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], where
        assert isinstance(doc.get("kind"), str) and doc["kind"], where
        name = doc.get("metadata", {}).get("name")
        assert isinstance(name, str) and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), (where, name)
        assert len(name) <= 63, name
        labels = doc["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/instance") == "ms", (where, labels)
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", where
        key = (doc["kind"], name)
        assert key not in seen, f"duplicate {key}"
        seen.add(key)


def test_default_render_has_the_expected_objects(default_render: Rendered) -> None:
    deployments = default_render.by_component("Deployment")
    services = default_render.by_component("Service")
    assert set(deployments) == DEFAULT_ON | {"redis"}
    assert set(services) == DEFAULT_ON | {"redis"}
    assert set(default_render.by_component("HorizontalPodAutoscaler")) == {"gateway", "tokenizer"}
    assert set(default_render.by_component("PodDisruptionBudget")) == DEFAULT_ON
    assert [c["metadata"]["name"] for c in default_render.of_kind("ConfigMap")] == ["ms-meshserve-config"]
    assert default_render.of_kind("ServiceAccount")
    assert not default_render.of_kind("ServiceMonitor"), "ServiceMonitor must be off by default"
    assert not default_render.of_kind("Secret"), "no API keys by default"


def test_gpu_render_has_the_expected_objects(gpu_render: Rendered, gpu_values: dict[str, Any]) -> None:
    deployments = gpu_render.by_component("Deployment")
    assert set(deployments) == (DEFAULT_ON - {"embedding"}) | {"encoder", "prefill", "redis"}
    hpas = gpu_render.by_component("HorizontalPodAutoscaler")
    assert set(hpas) == {"gateway", "tokenizer", "encoder", "prefill"}
    for component, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        target = hpa["spec"]["scaleTargetRef"]
        assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"ms-meshserve-{component}"}
        assert "replicas" not in deployments[component]["spec"], "the HPA owns the replica count"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert hpas["encoder"]["spec"]["minReplicas"] == 2
    assert deployments["decoder"]["spec"]["replicas"] == 4
    for component in ("decoder", "encoder", "prefill"):
        limits = container(deployments[component])["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1, component
        env = env_of(deployments[component])
        assert env["MESHSERVE_DEVICE"]["value"] == "cuda"
        assert env["MESHSERVE_DTYPE"]["value"] == "bfloat16"
        assert container(deployments[component])["image"].endswith(":0.1.0-cuda")
    for component in ("gateway", "tokenizer", "scheduler", "encoder-cache"):
        assert "nvidia.com/gpu" not in container(deployments[component])["resources"].get("limits", {})
        assert container(deployments[component])["image"] == "registry.example.com/meshserve:0.1.0"
    (monitor,) = gpu_render.of_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics", "http"}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The model volume is mounted read-only where the model is loaded, and nowhere else.
    for component, deployment in deployments.items():
        mounts = {m["name"]: m for m in container(deployment).get("volumeMounts", [])}
        if component in {"tokenizer", "decoder", "encoder", "prefill"}:
            assert mounts["model"]["readOnly"] is True and mounts["model"]["mountPath"] == "/models"
            volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
            assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "llm-models"
        else:
            assert "model" not in mounts, component
    assert gpu_values["decoder"]["replicas"] == 4


# ---------------------------------------------------------------------------- probes, lifecycle


def test_probes_use_grpc_health_for_grpc_services_and_http_for_the_gateway(any_render: Rendered) -> None:
    for component, deployment in meshserve_deployments(any_render).items():
        c = container(deployment)
        port = main_port(deployment)
        if component in GRPC:
            for probe in ("readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"] == {"port": port}, (component, probe)
        else:
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            # /health reports upstream readiness: liveness must not restart gateways for it.
            assert "httpGet" not in c["livenessProbe"] or c["livenessProbe"]["httpGet"]["path"] != "/health"
        # Every service: liveness waits for a first answer (a slow start is not killed).
        startup = c["startupProbe"]
        if component in GRPC:
            assert startup["grpc"] == {"port": port}, component
        else:
            assert startup["tcpSocket"] == c["livenessProbe"]["tcpSocket"] == {"port": "http"}
        room = 300 if component in WORKERS else 120
        assert startup["periodSeconds"] * startup["failureThreshold"] >= room, component


def test_termination_grace_exceeds_drain_plus_prestop(any_render: Rendered) -> None:
    for component, deployment in meshserve_deployments(any_render).items():
        c = container(deployment)
        drain = float(env_of(deployment)["MESHSERVE_DRAIN_TIMEOUT_S"]["value"])
        sleep_cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep_cmd[0] == "sleep", component
        pre_stop = float(sleep_cmd[1])
        assert pre_stop > 0
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > drain + pre_stop, (component, grace, drain, pre_stop)
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= drain, "liveness must outlast a drain"


def test_pods_run_as_non_root(any_render: Rendered) -> None:
    for deployment in any_render.of_kind("Deployment"):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"].get("runAsUser", 0) != 0, name
        assert pod.get("automountServiceAccountToken") is False, name
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name


# ---------------------------------------------------------------------------- launcher parity


def test_services_match_the_launcher(default_render: Rendered, launcher_specs: dict[str, Any]) -> None:
    deployments = meshserve_deployments(default_render)
    missing = set(launcher_specs) - set(deployments)
    assert not missing, f"the launcher starts {missing} but the chart (default values) does not deploy it"
    assert set(deployments) - set(launcher_specs) <= CHART_ONLY
    for component, spec in launcher_specs.items():
        command = container(deployments[component])["command"]
        assert command == ["python", "-m", spec.module], component
        assert COMPONENTS[component][0] == spec.module


def test_ports_match_the_launcher(
    any_render: Rendered, launcher: Any, launcher_specs: dict[str, Any]
) -> None:
    deployments = meshserve_deployments(any_render)
    services = any_render.by_component("Service")
    for component, deployment in deployments.items():
        port = main_port(deployment)
        if component in config.DEFAULT_PORTS:
            assert port == config.DEFAULT_PORTS[component], component
        if component in launcher_specs:
            assert port == launcher_specs[component].port, component
        assert env_of(deployment)["MESHSERVE_PORT"]["value"] == str(port)
        service_ports = {p["name"]: p["port"] for p in services[component]["spec"]["ports"]}
        assert port in service_ports.values(), component


def test_decoders_serve_the_token_path_on_their_grpc_port(any_render: Rendered) -> None:
    """The token path is Worker.GenerateStream on the gRPC port: no workload declares a
    second serving port (only metrics beside it)."""
    for component, deployment in meshserve_deployments(any_render).items():
        ports = {p["name"] for p in container(deployment)["ports"]}
        assert ports <= {"grpc", "http", "metrics"}, (component, ports)


def test_env_covers_everything_the_launcher_passes(
    any_render: Rendered, launcher_specs: dict[str, Any]
) -> None:
    deployments = meshserve_deployments(any_render)
    for component, spec in launcher_specs.items():
        if component not in deployments:
            continue
        env = env_of(deployments[component])
        missing = sorted(set(spec.env) - set(env))
        assert not missing, f"{component}: the launcher passes {missing}; add them to templates/_env.tpl"
        for name, launcher_value in spec.env.items():
            entry = env[name]
            address = re.fullmatch(r"127\.0\.0\.1:(\d+)", launcher_value)
            if address and "value" in entry:  # same port, cluster host name
                assert entry["value"].endswith(":" + address.group(1)), (component, name, entry)
            elif name in ("MESHSERVE_ROLE", "MESHSERVE_PORT"):
                assert entry.get("value") == launcher_value, (component, name, entry)


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_env_names_are_config_fields(
    component: str, default_render: Rendered, gpu_render: Rendered, launcher_specs: dict[str, Any]
) -> None:
    fields = config_fields(COMPONENTS[component][1])
    launcher_env = set(launcher_specs[component].env) if component in launcher_specs else set()
    allowed = fields | launcher_env | PENDING_ENV.get(component, set())
    rendered = [r for r in (default_render, gpu_render) if component in meshserve_deployments(r)]
    assert rendered, f"{component} is not deployed by either values set"
    for r in rendered:
        names = {n for n in env_of(meshserve_deployments(r)[component]) if n.startswith("MESHSERVE_")}
        unknown = sorted(names - allowed)
        assert not unknown, f"{component}: {unknown} are not fields of {COMPONENTS[component][1]}"


# ---------------------------------------------------------------------------- chart defaults

# MESHSERVE_* values the chart's defaults set on purpose to something other than the
# service's own default (or to what only the cluster knows), and why.
CHART_CHOICES = {
    "MESHSERVE_HOST": "pods listen on every interface",
    "MESHSERVE_PORT": "each role's port (test_ports_match_the_launcher)",
    "MESHSERVE_METRICS_PORT": "metrics on by default in a cluster",
    "MESHSERVE_DRAIN_TIMEOUT_S": "each component's drainTimeoutSeconds, also its termination grace",
    "MESHSERVE_MODEL_DIR": "the models baked into the image",
    "MESHSERVE_SERVED_MODEL_NAME": "the embedding model's API name",
    "MESHSERVE_ROLE": "one Deployment per role",
    "MESHSERVE_REDIS_URL": "the bundled Redis Service",
    "MESHSERVE_TOKENIZER_ADDRESS": "the tokenizer Service",
    "MESHSERVE_SCHEDULER_ADDRESS": "the scheduler Service",
    "MESHSERVE_ENCODER_CACHE_ADDRESS": "the encoder cache Service",
    "MESHSERVE_DEVICE": "concrete device from gpus",
    "MESHSERVE_MAX_LORAS": "lora.enabled turns LoRA on (4 resident, as the launcher with adapters)",
    "MESHSERVE_ENABLE_RUNTIME_LORA_UPDATING": "lora.runtimeUpdating",
}


def test_chart_defaults_are_the_services(render: Callable[..., Rendered]) -> None:
    """Every literal MESHSERVE_* value the chart's default values give (every component and
    LoRA switched on) is the default of the service's config field, unless CHART_CHOICES
    says why not; and values.yaml's ports are services.config.DEFAULT_PORTS."""
    every = render({"prefill": {"enabled": True}, "encoder": {"enabled": True}, "lora": {"enabled": True}})
    (config_map,) = every.of_kind("ConfigMap")
    checked: set[str] = set()
    for component, deployment in meshserve_deployments(every).items():
        options = {o.env: o for cls in config_classes(COMPONENTS[component][1]) for o in config.options(cls)}
        if component not in WORKERS - {"decoder"}:  # the other roles set their port
            assert options["MESHSERVE_PORT"].default == config.DEFAULT_PORTS[component], component
        for name, entry in env_of(deployment).items():
            key = entry.get("valueFrom", {}).get("configMapKeyRef", {}).get("key")
            value = config_map["data"][key] if key else entry.get("value")
            if name not in options or name in CHART_CHOICES or value is None or "$(" in value:
                continue
            option = options[name]
            assert option.parse(value) == option.default, (component, name, value)
            checked.add(name)
    assert {"MESHSERVE_MAX_NUM_SEQS", "MESHSERVE_KV_CACHE_MEMORY_MB", "MESHSERVE_BLOCK_SIZE"} <= checked
    assert {"MESHSERVE_CAPACITY_MB", "MESHSERVE_STREAM_INTERVAL", "MESHSERVE_MAX_LORA_RANK"} <= checked
    ports = yaml.safe_load((CHART / "values.yaml").read_text())["ports"]
    chart_ports = {re.sub(r"([A-Z])", lambda m: "-" + m.group(1).lower(), k): v for k, v in ports.items()}
    assert chart_ports == config.DEFAULT_PORTS


# ---------------------------------------------------------------------------- scheduler replicas


def test_one_scheduler_replica_by_default(default_render: Rendered) -> None:
    assert yaml.safe_load((CHART / "values.yaml").read_text())["scheduler"]["replicas"] == 1
    assert meshserve_deployments(default_render)["scheduler"]["spec"]["replicas"] == 1


@pytest.mark.parametrize(
    "redis",
    [
        {},
        {"enabled": False, "url": "redis://cache.infra:6379/0"},
        {"enabled": False, "existingSecret": {"name": "r"}},
    ],
    ids=["bundled", "url", "secret"],
)
def test_scheduler_replicas_share_redis_behind_one_service(
    render: Callable[..., Rendered], redis: dict[str, Any]
) -> None:
    r = render({"scheduler": {"replicas": 3}, "redis": redis})
    deployments = meshserve_deployments(r)
    assert deployments["scheduler"]["spec"]["replicas"] == 3
    assert "MESHSERVE_REDIS_URL" in env_of(deployments["scheduler"])
    # One ClusterIP Service in front of every replica: clients need no list of pods.
    service = r.by_component("Service")["scheduler"]
    assert service["spec"].get("clusterIP") != "None"
    address = f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    for component in ("gateway", "decoder", "embedding"):
        assert env_of(deployments[component])["MESHSERVE_SCHEDULER_ADDRESS"]["value"] == address, component


@pytest.mark.parametrize(
    "scheduler",
    [{"replicas": 2}, {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}}],
    ids=["replicas", "autoscaling"],
)
def test_several_schedulers_without_redis_do_not_render(
    helm: Any, render: Callable[..., Rendered], scheduler: dict[str, Any]
) -> None:
    with pytest.raises(helm.errors.HelmRenderError, match="needs Redis"):
        render({"scheduler": scheduler, "redis": {"enabled": False}})
    alone = render({"redis": {"enabled": False}})  # one scheduler keeps local state: fine
    assert meshserve_deployments(alone)["scheduler"]["spec"]["replicas"] == 1


# ---------------------------------------------------------------------------- wiring


def test_workers_register_with_their_pod_ip(any_render: Rendered) -> None:
    deployments = meshserve_deployments(any_render)
    scheduler = any_render.by_component("Service")["scheduler"]
    scheduler_port = scheduler["spec"]["ports"][0]["port"]
    for component in WORKERS & set(deployments):
        deployment = deployments[component]
        entries = container(deployment)["env"]
        names = [e["name"] for e in entries]
        env = env_of(deployment)
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["MESHSERVE_ADVERTISE_ADDRESS"]["value"] == f"$(POD_IP):{main_port(deployment)}"
        # $(VAR) only expands variables defined earlier in the list.
        assert names.index("POD_IP") < names.index("MESHSERVE_ADVERTISE_ADDRESS")
        assert names.index("POD_NAME") < names.index("MESHSERVE_WORKER_ID")
        assert env["MESHSERVE_WORKER_ID"]["value"] == "$(POD_NAME)"
        assert env["MESHSERVE_ROLE"]["value"] == component
        assert env["MESHSERVE_SCHEDULER_ADDRESS"]["value"] == f"ms-meshserve-scheduler:{scheduler_port}"
        assert any_render.by_component("Service")[component]["spec"]["clusterIP"] == "None"


def test_addresses_point_at_rendered_services(any_render: Rendered) -> None:
    services = {s["metadata"]["name"]: s for s in any_render.of_kind("Service")}
    for component, deployment in meshserve_deployments(any_render).items():
        for name, entry in env_of(deployment).items():
            if not name.endswith("_ADDRESS") or name == "MESHSERVE_ADVERTISE_ADDRESS":
                continue
            host, port = entry["value"].rsplit(":", 1)
            assert host in services, (component, name, entry["value"])
            assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}, (component, name)
    (config_map,) = any_render.of_kind("ConfigMap")
    redis_url = config_map["data"]["redis-url"]
    host_port = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", redis_url)
    assert host_port and host_port.group(1) in services, redis_url


def test_config_map_and_secret_refs_resolve(render: Callable[..., Rendered]) -> None:
    r = render({"apiKeys": {"keys": ["k1", "k2"]}})
    (config_map,) = r.of_kind("ConfigMap")
    secrets = {s["metadata"]["name"]: s for s in r.of_kind("Secret")}
    for component, deployment in meshserve_deployments(r).items():
        for entry in env_of(deployment).values():
            ref = entry.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                assert ref["configMapKeyRef"]["name"] == config_map["metadata"]["name"]
                assert ref["configMapKeyRef"]["key"] in config_map["data"], (component, entry)
            if "secretKeyRef" in ref:
                secret = secrets[ref["secretKeyRef"]["name"]]
                assert ref["secretKeyRef"]["key"] in secret["stringData"]
    gateway = env_of(meshserve_deployments(r)["gateway"])
    key_ref = gateway["MESHSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert secrets[key_ref["name"]]["stringData"][key_ref["key"]] == "k1,k2"


def test_existing_secrets_and_external_redis(render: Callable[..., Rendered]) -> None:
    r = render(
        {
            "apiKeys": {"existingSecret": "my-keys", "secretKey": "keys"},
            "redis": {"enabled": False, "existingSecret": {"name": "redis-auth", "key": "url"}},
        }
    )
    assert not r.of_kind("Secret")
    assert "redis" not in r.by_component("Deployment")
    for component, deployment in meshserve_deployments(r).items():
        env = env_of(deployment)
        assert env["MESHSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "url"}
        if component == "gateway":
            assert env["MESHSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
                "name": "my-keys",
                "key": "keys",
            }
    external = render({"redis": {"enabled": False, "url": "redis://cache.infra:6379/3"}})
    assert external.of_kind("ConfigMap")[0]["data"]["redis-url"] == "redis://cache.infra:6379/3"


def test_config_overrides_render_as_env(render: Callable[..., Rendered]) -> None:
    r = render(
        {
            "decoder": {
                "config": {
                    "max_num_batched_tokens": 1000000,
                    "enable_prefix_caching": False,
                    "advertise_address": "[$(POD_IP)]:50061",  # IPv6
                }
            },
            "scheduler": {"config": {"routing_policy": "least_load", "load_cap": 0.5}},
            "tokenizer": {"config": {"allowed_media_domains": ["a.example", "b.example"]}},
            "extraEnv": [{"name": "OMP_NUM_THREADS", "value": "4"}],
        }
    )
    deployments = meshserve_deployments(r)
    decoder = env_of(deployments["decoder"])
    assert decoder["MESHSERVE_MAX_NUM_BATCHED_TOKENS"]["value"] == "1000000"  # not 1e+06
    assert decoder["MESHSERVE_ENABLE_PREFIX_CACHING"]["value"] == "false"
    assert decoder["MESHSERVE_ADVERTISE_ADDRESS"]["value"] == "[$(POD_IP)]:50061"
    names = list(decoder)
    assert names.index("POD_IP") < names.index("MESHSERVE_ADVERTISE_ADDRESS")
    scheduler = env_of(deployments["scheduler"])
    assert scheduler["MESHSERVE_ROUTING_POLICY"] == {
        "name": "MESHSERVE_ROUTING_POLICY",
        "value": "least_load",
    }
    assert scheduler["MESHSERVE_LOAD_CAP"]["value"] == "0.5"
    tokenizer = env_of(deployments["tokenizer"])
    assert tokenizer["MESHSERVE_ALLOWED_MEDIA_DOMAINS"]["value"] == "a.example,b.example"
    assert all(env_of(d)["OMP_NUM_THREADS"]["value"] == "4" for d in deployments.values())


def test_metrics_port_follows_values(default_render: Rendered, render: Callable[..., Rendered]) -> None:
    for component, deployment in meshserve_deployments(default_render).items():
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        if component in GRPC:
            assert env_of(deployment)["MESHSERVE_METRICS_PORT"]["value"] == str(ports["metrics"]) == "9090"
        else:
            assert "metrics" not in ports  # the gateway serves /metrics on its HTTP port
    off = render({"metrics": {"enabled": False}})
    for component, deployment in meshserve_deployments(off).items():
        if component in GRPC:
            assert env_of(deployment)["MESHSERVE_METRICS_PORT"]["value"] == "0"
        assert "metrics" not in {p["name"] for p in container(deployment)["ports"]}


def test_selectors_match_exactly_one_workload(any_render: Rendered) -> None:
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in any_render.of_kind("Deployment")
    }

    def matching(selector: dict[str, str]) -> list[str]:
        return [name for name, labels in pods.items() if selector.items() <= labels.items()]

    for deployment in any_render.of_kind("Deployment"):
        assert matching(deployment["spec"]["selector"]["matchLabels"]) == [deployment["metadata"]["name"]]
    for service in any_render.of_kind("Service"):
        assert len(matching(service["spec"]["selector"])) == 1, service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            (workload,) = matching(service["spec"]["selector"])
            deployment = any_render.get("Deployment", workload)
            assert deployment is not None
            names = {
                p["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]
            }
            assert target in names, (service["metadata"]["name"], target)
    for pdb in any_render.of_kind("PodDisruptionBudget"):
        assert len(matching(pdb["spec"]["selector"]["matchLabels"])) == 1, pdb["metadata"]["name"]


def test_lora_adapters_from_a_volume(render: Callable[..., Rendered]) -> None:
    r = render(
        {
            "lora": {
                "enabled": True,
                "modules": {"sql": "/adapters/sql", "chat": "/adapters/chat"},
                "volume": {"persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}},
                "maxLoras": 2,
                "runtimeUpdating": True,
                "adminApiKeys": {"existingSecret": "admins", "secretKey": "keys"},
            }
        }
    )
    deployments = meshserve_deployments(r)
    decoder = env_of(deployments["decoder"])
    assert decoder["MESHSERVE_LORA_MODULES"]["value"] == "chat=/adapters/chat,sql=/adapters/sql"
    assert decoder["MESHSERVE_MAX_LORAS"]["value"] == "2"
    assert decoder["MESHSERVE_ENABLE_RUNTIME_LORA_UPDATING"]["value"] == "true"
    mounts = {m["name"]: m for m in container(deployments["decoder"])["volumeMounts"]}
    assert mounts["lora-adapters"] == {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True}
    volumes = {v["name"]: v for v in deployments["decoder"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["lora-adapters"]["persistentVolumeClaim"]["claimName"] == "adapters"
    assert "lora-adapters" not in {m["name"] for m in container(deployments["embedding"])["volumeMounts"]}
    gateway = env_of(deployments["gateway"])
    assert gateway["MESHSERVE_ENABLE_LORA_UPDATING"]["value"] == "true"
    assert gateway["MESHSERVE_ADMIN_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "admins",
        "key": "keys",
    }
    off = env_of(meshserve_deployments(render({}))["decoder"])
    assert "MESHSERVE_MAX_LORAS" not in off
