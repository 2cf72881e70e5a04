"""The chart's pod specs as a container runtime runs them: every Deployment of a rendered
chart becomes pods, each pod a pause container (the pod's network namespace, IP, hostname
and Service names as network aliases) plus its app container joined to it, started with
the docker run arguments that carry what the kubelet enforces: the command and args, the
env (values, $(VAR) expansion, fieldRef, resourceFieldRef, ConfigMap and Secret keys), the
securityContext (numeric user, read-only root filesystem, dropped capabilities, no new
privileges), resources as cgroup limits, emptyDirs, and the probes (kept as data for the
prober in deploy/check.py). Pure functions: no docker is needed to build the arguments."""

from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass, field
from typing import Any

from deploy.chart import Manifest, Rendered

_QUANTITY = re.compile(r"^([0-9.]+(?:e[0-9]+)?)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def quantity(value: Any) -> float:
    """A Kubernetes resource quantity ("500m", "2", "1Gi", 0.5) as a number."""
    match = _QUANTITY.match(str(value))
    if not match or match.group(2) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(match.group(1)) * _SUFFIX[match.group(2)]


@dataclass(frozen=True)
class Probe:
    """One kubelet probe: grpc (grpc.health.v1 Check), http (GET, 200-399), tcp, exec."""

    kind: str
    port: int = 0
    path: str = ""
    command: tuple[str, ...] = ()
    period_s: float = 10.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    initial_delay_s: float = 0.0


@dataclass
class PodPlan:
    """One pod of a Deployment, as the runtime will start it."""

    name: str
    deployment: str
    component: str
    image: str
    command: list[str] | None
    args: list[str] | None
    env: list[dict[str, Any]]
    aliases: list[str]
    ports: dict[str, int]
    user: str
    group_add: list[int] = field(default_factory=list)
    read_only: bool = False
    cap_drop: list[str] = field(default_factory=list)
    cap_add: list[str] = field(default_factory=list)
    no_new_privileges: bool = False
    limits: dict[str, float] = field(default_factory=dict)
    requests: dict[str, float] = field(default_factory=dict)
    tmpfs: list[str] = field(default_factory=list)
    shm_bytes: int = 0
    stop_timeout_s: int = 30
    probes: dict[str, Probe] = field(default_factory=dict)

    @property
    def pause_name(self) -> str:
        return f"{self.name}-pause"


def _port(value: Any, ports: dict[str, int]) -> int:
    return ports[value] if isinstance(value, str) else int(value)


def probe_of(spec: dict[str, Any], ports: dict[str, int]) -> Probe:
    """A container probe spec as a Probe (the kubelet's defaults for unset timings)."""
    timings = {
        "period_s": float(spec.get("periodSeconds", 10)),
        "timeout_s": float(spec.get("timeoutSeconds", 1)),
        "failure_threshold": int(spec.get("failureThreshold", 3)),
        "initial_delay_s": float(spec.get("initialDelaySeconds", 0)),
    }
    if "grpc" in spec:
        return Probe("grpc", port=_port(spec["grpc"]["port"], ports), **timings)  # type: ignore[arg-type]
    if "httpGet" in spec:
        get = spec["httpGet"]
        return Probe("http", port=_port(get["port"], ports), path=get.get("path", "/"), **timings)  # type: ignore[arg-type]
    if "tcpSocket" in spec:
        return Probe("tcp", port=_port(spec["tcpSocket"]["port"], ports), **timings)  # type: ignore[arg-type]
    if "exec" in spec:
        return Probe("exec", command=tuple(spec["exec"]["command"]), **timings)  # type: ignore[arg-type]
    raise ValueError(f"unsupported probe: {sorted(spec)}")


def _replicas(deployment: Manifest, rendered: Rendered) -> int:
    if "replicas" in deployment["spec"]:
        return int(deployment["spec"]["replicas"])
    name = deployment["metadata"]["name"]
    for hpa in rendered.of_kind("HorizontalPodAutoscaler"):
        if hpa["spec"]["scaleTargetRef"]["name"] == name:
            return int(hpa["spec"].get("minReplicas", 1))
    return 1


def _aliases(labels: dict[str, str], rendered: Rendered) -> list[str]:
    """Names of the Services whose selector picks pods with these labels."""
    return [
        s["metadata"]["name"]
        for s in rendered.of_kind("Service")
        if s["spec"].get("selector") and s["spec"]["selector"].items() <= labels.items()
    ]


def _user(pod_sc: dict[str, Any], sc: dict[str, Any]) -> tuple[str, list[int]]:
    merged = {**pod_sc, **sc}
    if "runAsUser" not in merged:
        raise ValueError("runAsUser unset: the image's USER would run unchecked")
    uid = int(merged["runAsUser"])
    if merged.get("runAsNonRoot") and uid == 0:
        raise ValueError("runAsNonRoot with runAsUser 0: the kubelet refuses to start it")
    gid = int(merged.get("runAsGroup", uid))
    groups = [int(pod_sc["fsGroup"])] if "fsGroup" in pod_sc else []
    return f"{uid}:{gid}", groups


def _volumes(pod: dict[str, Any], container: dict[str, Any]) -> tuple[list[str], int]:
    """emptyDir mounts as tmpfs paths, and the memory-medium one at /dev/shm as its size."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    tmpfs, shm = [], 0
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "emptyDir" not in volume:
            raise ValueError(f"volume {mount['name']}: only emptyDir volumes are run here")
        empty = volume["emptyDir"] or {}
        if mount["mountPath"] == "/dev/shm" and empty.get("medium") == "Memory":
            shm = int(quantity(empty.get("sizeLimit", "64Mi")))
        else:
            tmpfs.append(mount["mountPath"])
    return tmpfs, shm


def plan_pods(rendered: Rendered) -> list[PodPlan]:
    """Every pod the chart's Deployments ask for (replicas, or the HPA's minReplicas)."""
    plans = []
    for deployment in rendered.of_kind("Deployment"):
        template = deployment["spec"]["template"]
        pod = template["spec"]
        if pod.get("enableServiceLinks", True):
            raise ValueError(f"{deployment['metadata']['name']}: service links are not reproduced here")
        (container,) = pod["containers"]
        ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports", [])}
        sc = container.get("securityContext", {})
        user, groups = _user(pod.get("securityContext", {}), sc)
        tmpfs, shm = _volumes(pod, container)
        resources = container.get("resources", {})
        labels = template["metadata"]["labels"]
        for i in range(_replicas(deployment, rendered)):
            plans.append(
                PodPlan(
                    name=f"{deployment['metadata']['name']}-{i}",
                    deployment=deployment["metadata"]["name"],
                    component=labels.get("app.kubernetes.io/component", container["name"]),
                    image=container["image"],
                    command=container.get("command"),
                    args=container.get("args"),
                    env=container.get("env", []),
                    aliases=_aliases(labels, rendered),
                    ports=ports,
                    user=user,
                    group_add=groups,
                    read_only=bool(sc.get("readOnlyRootFilesystem")),
                    cap_drop=list(sc.get("capabilities", {}).get("drop", [])),
                    cap_add=list(sc.get("capabilities", {}).get("add", [])),
                    no_new_privileges=sc.get("allowPrivilegeEscalation") is False,
                    limits={k: quantity(v) for k, v in resources.get("limits", {}).items()},
                    requests={k: quantity(v) for k, v in resources.get("requests", {}).items()},
                    tmpfs=tmpfs,
                    shm_bytes=shm,
                    stop_timeout_s=int(pod.get("terminationGracePeriodSeconds", 30)),
                    probes={p: probe_of(container[p], ports) for p in PROBES if p in container},
                )
            )
    return plans


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined names are replaced, $$ escapes, others stay."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


@dataclass(frozen=True)
class PodFacts:
    """What the API server and the node know of a running pod, for env valueFrom."""

    name: str
    namespace: str
    ip: str
    node_cpus: int


def _value_from(ref: dict[str, Any], plan: PodPlan, facts: PodFacts, rendered: Rendered) -> str:
    if "fieldRef" in ref:
        fields = {
            "metadata.name": facts.name,
            "metadata.namespace": facts.namespace,
            "status.podIP": facts.ip,
        }
        return fields[ref["fieldRef"]["fieldPath"]]
    if "resourceFieldRef" in ref:
        resource = ref["resourceFieldRef"]["resource"]
        kind, _, name = resource.partition(".")
        amounts = plan.limits if kind == "limits" else plan.requests
        amount = amounts.get(name, float(facts.node_cpus) if name == "cpu" else 0.0)
        return str(math.ceil(amount / quantity(ref["resourceFieldRef"].get("divisor", "1"))))
    if "configMapKeyRef" in ref:
        key_ref = ref["configMapKeyRef"]
        config_map = rendered.get("ConfigMap", key_ref["name"])
        if config_map is None:
            raise ValueError(f"ConfigMap {key_ref['name']} is not in the release")
        return str(config_map["data"][key_ref["key"]])
    if "secretKeyRef" in ref:
        key_ref = ref["secretKeyRef"]
        secret = rendered.get("Secret", key_ref["name"])
        if secret is None:
            raise ValueError(f"Secret {key_ref['name']} is not in the release")
        if key_ref["key"] in secret.get("stringData", {}):
            return str(secret["stringData"][key_ref["key"]])
        return base64.b64decode(secret["data"][key_ref["key"]]).decode()
    raise ValueError(f"unsupported valueFrom: {sorted(ref)}")


def resolve_env(plan: PodPlan, facts: PodFacts, rendered: Rendered) -> dict[str, str]:
    """The container's environment in list order, as the kubelet builds it."""
    env: dict[str, str] = {}
    for entry in plan.env:
        if "valueFrom" in entry:
            env[entry["name"]] = _value_from(entry["valueFrom"], plan, facts, rendered)
        else:
            env[entry["name"]] = expand(str(entry.get("value", "")), env)
    return env


def pause_args(plan: PodPlan, network: str, pause_image: str, labels: dict[str, str]) -> list[str]:
    """`docker run` arguments of the pod's pause container: its network identity."""
    args = ["run", "-d", "--name", plan.pause_name, "--hostname", plan.name, "--network", network]
    for alias in plan.aliases:
        args += ["--network-alias", alias]
    for key, value in labels.items():
        args += ["--label", f"{key}={value}"]
    args += [
        "--user",
        "65535:65535",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
    ]
    return [*args, "--entrypoint", "catatonit", pause_image, "-P"]


def _resource_args(plan: PodPlan) -> list[str]:
    args = []
    if "memory" in plan.limits:
        args += ["--memory", str(int(plan.limits["memory"]))]
    if "memory" in plan.requests:
        args += ["--memory-reservation", str(int(plan.requests["memory"]))]
    if "cpu" in plan.limits:
        args += ["--cpus", f"{plan.limits['cpu']:g}"]
    if "cpu" in plan.requests:  # the kubelet's cpu.shares: milli-CPUs * 1024 / 1000
        args += ["--cpu-shares", str(max(2, int(plan.requests["cpu"] * 1024)))]
    return args


def container_args(plan: PodPlan, env: dict[str, str], labels: dict[str, str]) -> list[str]:
    """`docker run` arguments of the pod's app container, joined to its pause container.

    `command` replaces the image's ENTRYPOINT and `args` its CMD, as in Kubernetes. Images
    are never pulled (no registry here): they must have been built on this host."""
    args = ["run", "-d", "--name", plan.name, "--network", f"container:{plan.pause_name}"]
    args += ["--pull", "never", "--user", plan.user]
    for gid in plan.group_add:
        args += ["--group-add", str(gid)]
    if plan.read_only:
        args.append("--read-only")
    for cap in plan.cap_drop:
        args += ["--cap-drop", cap]
    for cap in plan.cap_add:
        args += ["--cap-add", cap]
    if plan.no_new_privileges:
        args += ["--security-opt", "no-new-privileges"]
    args += _resource_args(plan)
    # emptyDir: writable by the pod's user, like the kubelet's 0777 dir (a tmpfs over a path
    # the image has takes that directory's owner and mode, whatever mode= says, hence uid/gid),
    # and exec (docker's tmpfs default is noexec; the engine loads the kernels it compiles there).
    owner, _, group = plan.user.partition(":")
    for path in plan.tmpfs:
        args += ["--tmpfs", f"{path}:rw,exec,nosuid,nodev,mode=1777,uid={owner},gid={group or owner}"]
    if plan.shm_bytes:
        args += ["--shm-size", str(plan.shm_bytes)]
    args += ["--stop-timeout", str(plan.stop_timeout_s)]
    for key, value in labels.items():
        args += ["--label", f"{key}={value}"]
    for name, value in env.items():
        args += ["--env", f"{name}={value}"]
    tail: list[str] = []
    if plan.command:
        args += ["--entrypoint", plan.command[0]]
        tail = [expand(a, env) for a in plan.command[1:]]
    return [*args, plan.image, *tail, *[expand(a, env) for a in plan.args or []]]
