"""`make deploy-check`: the Helm chart's pods run by docker on this host, probed as the
kubelet probes them, then served through and a decoder killed mid-stream.

Renders the chart (deploy/chart.py) with deploy/helm/examples/deploy-check-values.yaml,
starts every Deployment's pods (deploy/pods.py: a pause container per pod on an internal
network, each Service name an alias, the app container with the rendered env, ConfigMap and
Secret values, securityContext and resources), polls startup/readiness/liveness probes until
every pod is Ready (a dead or unlive container is restarted, as with restartPolicy Always),
sends a streamed chat completion and an embedding through the gateway, kills the decoder
serving a stream and checks that the stream completes and the decoder is Ready again.
Beside the pods, `make serve`'s mesh runs on the same host, with as many decoders as the
chart's values deploy: each decoder container's engine
must be the one `make serve` gets (deploy/served.py: dtype, attention, compiled, native
kernels), and `vllm bench serve` through the gateway container must reach
MIN_THROUGHPUT_RATIO of `make serve`'s output tok/s at every concurrency, medians of
rounds that alternate between the two (both up, one benchmarked at a time).
Prints a table of the pods and writes deploy/results/deploy_check.json (also when a check
fails: its `failures` say which)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.host import commit
from bench.served_vs_vllm import median_table
from deploy import served
from deploy.chart import NAMESPACE, RELEASE, ROOT, Rendered, render
from deploy.pods import PodFacts, PodPlan, Probe, container_args, pause_args, plan_pods, resolve_env

VALUES = ROOT / "deploy" / "helm" / "examples" / "deploy-check-values.yaml"
RESULTS = ROOT / "deploy" / "results" / "deploy_check.json"
LOGS = ROOT / "build" / "deploy-check" / "logs"
# `docker exec` itself takes seconds on a loaded host; an exec probe's timeoutSeconds is
# meant for its command, so the runtime's start-up gets this on top.
EXEC_OVERHEAD_S = 5.0
NETWORK = "meshserve-deploy-check"
LABEL = "io.meshserve.deploy-check"
MODEL_DIR = ROOT / ".cache" / "models" / "smollm2-135m-instruct"  # `make model`, baked into the image
MIN_THROUGHPUT_RATIO = 0.9  # deployed / `make serve` output tok/s


def docker(*args: str, check: bool = True, timeout: float = 120) -> str:
    """Runs the docker CLI; a failure raises with docker's own message."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} ...: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


@dataclass
class Pod:
    """A pod's runtime state, as the kubelet keeps it."""

    plan: PodPlan
    ip: str = ""
    env: dict[str, str] | None = None
    started_at: float = 0.0
    started: bool = False
    ready: bool = False
    ready_at: float | None = None
    restarts: int = 0
    restarting: bool = False
    failures: dict[str, int] | None = None

    def reset(self, now: float) -> None:
        self.started_at, self.started, self.ready, self.ready_at = now, False, False, None
        self.failures = {}


async def probe_once(probe: Probe, pod: Pod) -> bool:
    """One probe attempt from the node, as the kubelet runs it."""
    try:
        if probe.kind == "grpc":
            async with grpc.aio.insecure_channel(f"{pod.ip}:{probe.port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=probe.timeout_s
                )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        if probe.kind == "http":
            async with httpx.AsyncClient(timeout=probe.timeout_s) as client:
                response = await client.get(f"http://{pod.ip}:{probe.port}{probe.path}")
            return 200 <= response.status_code < 400
        if probe.kind == "tcp":
            _, writer = await asyncio.wait_for(asyncio.open_connection(pod.ip, probe.port), probe.timeout_s)
            writer.close()
            return True
        proc = await asyncio.create_subprocess_exec(
            "docker",
            "exec",
            pod.plan.name,
            *probe.command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            return await asyncio.wait_for(proc.wait(), probe.timeout_s + EXEC_OVERHEAD_S) == 0
        except TimeoutError:
            proc.kill()
            raise
    except (TimeoutError, grpc.RpcError, httpx.HTTPError, OSError):
        return False


class Kubelet:
    """Starts the pods and keeps them running: probes, restarts, Ready times."""

    def __init__(self, rendered: Rendered, plans: list[PodPlan], pause_image: str) -> None:
        self.rendered = rendered
        self.pods = {p.name: Pod(p) for p in plans}
        self.pause_image = pause_image
        self.labels = {LABEL: "1"}
        self.events: list[str] = []
        self.stopping = False

    def start(self) -> None:
        docker("network", "create", "--internal", "--label", f"{LABEL}=1", NETWORK)
        for pod in self.pods.values():
            docker(*pause_args(pod.plan, NETWORK, self.pause_image, self.labels))
            pod.ip = docker(
                "inspect",
                "-f",
                f'{{{{(index .NetworkSettings.Networks "{NETWORK}").IPAddress}}}}',
                pod.plan.pause_name,
            )
            facts = PodFacts(
                name=pod.plan.name, namespace=NAMESPACE, ip=pod.ip, node_cpus=os.cpu_count() or 1
            )
            pod.env = resolve_env(pod.plan, facts, self.rendered)
        for pod in self.pods.values():
            self.run_container(pod)

    def run_container(self, pod: Pod) -> None:
        assert pod.env is not None
        if pod.restarts:  # the previous container's log, as `kubectl logs --previous` keeps it
            LOGS.mkdir(parents=True, exist_ok=True)
            with open(LOGS / f"{pod.plan.name}.{pod.restarts - 1}.log", "w") as log:
                subprocess.run(
                    ["docker", "logs", pod.plan.name], stdout=log, stderr=subprocess.STDOUT, check=False
                )
        docker("rm", "-f", pod.plan.name, check=False)
        pod.reset(time.monotonic())
        docker(*container_args(pod.plan, pod.env, self.labels))

    def restart(self, pod: Pod, why: str) -> None:
        if pod.restarting:
            return
        pod.restarting = True
        try:
            pod.restarts += 1
            self.events.append(
                f"{time.strftime('%H:%M:%S')} {pod.plan.name}: {why}, restarted (#{pod.restarts})"
            )
            print(self.events[-1], flush=True)
            self.run_container(pod)
        finally:
            pod.restarting = False

    async def run(self) -> None:
        await asyncio.gather(self.watch_exits(), *(self.probe_loop(p) for p in self.pods.values()))

    async def watch_exits(self) -> None:
        """restartPolicy Always: a container that exited is started again."""
        while not self.stopping:
            asked = time.monotonic()
            running = await asyncio.to_thread(
                docker,
                "ps",
                "--filter",
                f"label={LABEL}",
                "--filter",
                "status=running",
                "--format",
                "{{.Names}}",
            )
            alive = set(running.split())
            for pod in self.pods.values():
                # A container (re)started after the question was asked may not be listed yet.
                if (
                    pod.plan.name not in alive
                    and pod.started_at < asked
                    and not pod.restarting
                    and not self.stopping
                ):
                    code = await asyncio.to_thread(
                        docker, "inspect", "-f", "{{.State.ExitCode}}", pod.plan.name, check=False
                    )
                    await asyncio.to_thread(self.restart, pod, f"exited ({code or 'gone'})")
            await asyncio.sleep(1.0)

    async def probe_loop(self, pod: Pod) -> None:
        due: dict[str, float] = {}
        while not self.stopping:
            now = time.monotonic()
            kinds = ["startupProbe"] if not pod.started and "startupProbe" in pod.plan.probes else []
            if not kinds:
                pod.started = True
                kinds = [k for k in ("readinessProbe", "livenessProbe") if k in pod.plan.probes]
            for kind in kinds:
                probe = pod.plan.probes[kind]
                if now < due.get(kind, pod.started_at + probe.initial_delay_s):
                    continue
                due[kind] = now + probe.period_s
                await self.step(pod, kind, probe, await probe_once(probe, pod))
            await asyncio.sleep(0.2)

    async def step(self, pod: Pod, kind: str, probe: Probe, ok: bool) -> None:
        assert pod.failures is not None
        pod.failures[kind] = 0 if ok else pod.failures.get(kind, 0) + 1
        failed = pod.failures[kind] >= probe.failure_threshold
        if kind == "startupProbe" and ok:
            pod.started = True
        elif kind == "readinessProbe":
            if ok and not pod.ready:
                pod.ready, pod.ready_at = True, time.monotonic()
            elif failed:
                pod.ready = False
        elif failed:  # startup or liveness: the kubelet kills and restarts the container
            await asyncio.to_thread(self.restart, pod, f"{kind} failed {probe.failure_threshold} times")

    async def wait_ready(self, timeout_s: float, names: list[str] | None = None) -> None:
        deadline, last = time.monotonic() + timeout_s, 0.0
        pods = [self.pods[n] for n in names] if names else list(self.pods.values())
        while not all(p.ready for p in pods):
            if time.monotonic() > deadline:
                waiting = [p.plan.name for p in pods if not p.ready]
                raise TimeoutError(f"not Ready after {timeout_s:.0f} s: {waiting}")
            if time.monotonic() - last > 30:
                last = time.monotonic()
                print("waiting for Ready:", " ".join(p.plan.name for p in pods if not p.ready), flush=True)
            await asyncio.sleep(0.5)

    def teardown(self) -> None:
        self.stopping = True
        ids = docker("ps", "-aq", "--filter", f"label={LABEL}", check=False).split()
        if ids:
            docker("rm", "-f", *ids, check=False)
        docker("network", "rm", NETWORK, check=False)


def image_report(plans: list[PodPlan]) -> dict[str, dict[str, Any]]:
    """Size of every image the pods run and its agreement with the pod specs that run it."""
    out: dict[str, dict[str, Any]] = {}
    for image in sorted({p.image for p in plans}):
        info = json.loads(docker("image", "inspect", image))[0]
        config = info["Config"]
        problems = []
        for plan in (p for p in plans if p.image == image):
            exposed = {int(k.split("/")[0]) for k in (config.get("ExposedPorts") or {})}
            if plan.component != "redis" and not set(plan.ports.values()) <= exposed:
                problems.append(f"{plan.component}: ports {sorted(plan.ports.values())} not all EXPOSEd")
            user = (config.get("User") or "").split(":")[0]
            if plan.component != "redis" and user != plan.user.split(":")[0]:
                problems.append(f"{plan.component}: image USER {user!r} != runAsUser {plan.user}")
        out[image] = {
            "id": info["Id"],
            "size_mb": round(info["Size"] / 2**20, 1),
            "user": config.get("User"),
            "problems": problems,
        }
    return out


def metric(ip: str, port: int, name: str, label: str = "") -> float:
    """Sum of a Prometheus metric's samples (those carrying `label`, e.g. 'outcome="migrated"')."""
    text = httpx.get(f"http://{ip}:{port}/metrics", timeout=5).text
    samples = re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
    return sum(float(m.group(2)) for m in samples if label in (m.group(1) or ""))


def serve_requests(gateway: str) -> dict[str, Any]:
    """/v1/models, a streamed chat completion and an embedding through the gateway."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{gateway}/v1", api_key="deploy-check", timeout=300)
    models = [m.id for m in client.models.list().data]
    llm = next(m for m in models if "MiniLM" not in m)
    embedder = next(m for m in models if "MiniLM" in m)
    started = time.monotonic()
    chunks, text, finish = 0, "", None
    stream = client.chat.completions.create(
        model=llm, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24, stream=True
    )
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    embedding = client.embeddings.create(model=embedder, input=["deploy check"]).data[0].embedding
    assert text and finish in ("stop", "length"), (text, finish)
    assert len(embedding) > 0
    return {
        "models": models,
        "chat": {
            "model": llm,
            "chunks": chunks,
            "finish_reason": finish,
            "text": text,
            "s": round(time.monotonic() - started, 2),
        },
        "embedding": {"model": embedder, "dims": len(embedding)},
    }


class LongStream:
    """A 160-token streamed chat completion read in a thread, counting chunks before and
    after `killed` is set; `under_way` is set after 8 chunks (or when the stream ends)."""

    def __init__(self, gateway: str, model: str) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=f"http://{gateway}/v1", api_key="deploy-check", timeout=600)
        self.model = model
        self.state: dict[str, Any] = {"chunks_before": 0, "chunks_after": 0, "finish_reason": None}
        self.under_way = threading.Event()
        self.killed = threading.Event()

    def read(self) -> None:
        stream = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
            max_tokens=160,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            for chunk in stream:
                self.state["chunks_after" if self.killed.is_set() else "chunks_before"] += 1
                if self.state["chunks_before"] >= 8:
                    self.under_way.set()
                if chunk.choices:
                    self.state["finish_reason"] = (
                        chunk.choices[0].finish_reason or self.state["finish_reason"]
                    )
        finally:
            self.under_way.set()


async def kill_mid_stream(kubelet: Kubelet, gateway: str, llm: str) -> dict[str, Any]:
    """Kills the decoder serving a stream: the stream must finish (the gateway counting one
    migration), and the restarted decoder must be Ready again."""
    decoders = [p for p in kubelet.pods.values() if p.plan.component == "decoder"]
    host, port = gateway.split(":")
    migrated = ("meshserve_gateway_migrations_total", 'outcome="migrated"')
    migrated_before = await asyncio.to_thread(metric, host, int(port), *migrated)
    stream = LongStream(gateway, llm)
    reader = asyncio.create_task(asyncio.to_thread(stream.read))
    await asyncio.to_thread(stream.under_way.wait, 300)
    running = "meshserve_worker_num_running"
    busy = [
        p for p in decoders if await asyncio.to_thread(metric, p.ip, p.plan.ports["metrics"], running) > 0
    ]
    assert busy and not reader.done(), "no decoder is serving the stream"
    victim = busy[0]
    stream.killed.set()
    killed_at = time.monotonic()
    await asyncio.to_thread(docker, "kill", victim.plan.name)
    print(f"killed {victim.plan.name} after {stream.state['chunks_before']} chunks", flush=True)
    await reader
    stream_s = time.monotonic() - killed_at
    assert stream.state["finish_reason"] == "length" and stream.state["chunks_after"] > 0, stream.state
    migrations = await asyncio.to_thread(metric, host, int(port), *migrated) - migrated_before
    assert migrations == 1, f"the gateway counted {migrations} migrations"
    await kubelet.wait_ready(600, [victim.plan.name])
    assert victim.ready_at is not None
    return {
        "killed": victim.plan.name,
        **stream.state,
        "gateway_migrations": migrations,
        "stream_after_kill_s": round(stream_s, 2),
        "restarts": victim.restarts,
        "kill_to_ready_s": round(victim.ready_at - killed_at, 1),
    }


def table(kubelet: Kubelet) -> str:
    rows = [("POD", "IMAGE", "IP", "READY", "START->READY s", "RESTARTS")]
    for pod in kubelet.pods.values():
        ready_s = f"{pod.ready_at - pod.started_at:.1f}" if pod.ready_at else "-"
        rows.append(
            (pod.plan.name, pod.plan.image, pod.ip, "1/1" if pod.ready else "0/1", ready_s, str(pod.restarts))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def pod_report(kubelet: Kubelet, first_ready: dict[str, float]) -> dict[str, Any]:
    """Per pod and per service: image, start-to-Ready of the first container, restarts."""
    pods = [
        {
            "pod": p.plan.name,
            "component": p.plan.component,
            "image": p.plan.image,
            "start_to_ready_s": first_ready.get(p.plan.name),
            "restarts": p.restarts,
        }
        for p in kubelet.pods.values()
    ]
    services = {
        component: {
            "pods": sum(p["component"] == component for p in pods),
            "start_to_ready_s": max(p["start_to_ready_s"] or 0 for p in pods if p["component"] == component),
        }
        for component in dict.fromkeys(p["component"] for p in pods)
    }
    return {"pods": pods, "services": services}


def deployed_engines(kubelet: Kubelet, make_serve: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """Each decoder container's engine configuration (its start-up line, from its log) and
    every difference from `make serve`'s."""
    engines, failures = {}, []
    for pod in (p for p in kubelet.pods.values() if p.plan.component == "decoder"):
        logs = subprocess.run(["docker", "logs", pod.plan.name], capture_output=True, text=True, check=False)
        engines[pod.plan.name] = served.engine_config(logs.stdout + logs.stderr)
        failures += [
            f"{pod.plan.name} {d}" for d in served.config_differences(engines[pod.plan.name], make_serve)
        ]
    return engines, failures


def redis_in_use(kubelet: Kubelet) -> tuple[dict[str, float], list[str]]:
    """The scheduler reaches Redis and has read the decoders' KV events through it (the
    requests just served stored blocks): prefix-aware routing works across pods."""
    scheduler = next(p for p in kubelet.pods.values() if p.plan.component == "scheduler")
    port = scheduler.plan.ports["metrics"]
    found = {
        "redis_up": metric(scheduler.ip, port, "meshserve_scheduler_redis_up"),
        "kv_events": metric(scheduler.ip, port, "meshserve_scheduler_kv_events_total"),
    }
    if found["redis_up"] == 1 and found["kv_events"] > 0:
        return found, []
    return found, [
        f"the scheduler does not use Redis (redis_up {found['redis_up']}, KV events {found['kv_events']})"
    ]


def throughput_failures(ratios: dict[str, float]) -> list[str]:
    return [
        f"throughput {key}: deployed / make serve = {ratio} < {MIN_THROUGHPUT_RATIO}"
        for key, ratio in ratios.items()
        if ratio < MIN_THROUGHPUT_RATIO
    ]


async def deployed_and_served(
    kubelet: Kubelet, args: argparse.Namespace, result: dict[str, Any]
) -> tuple[str, str]:
    """Every pod Ready, a chat and an embedding through the gateway, each decoder's engine
    held against `make serve`'s and Redis in use (into `result`); the gateway's address and
    the served LLM's name."""
    await kubelet.wait_ready(args.timeout)
    print(table(kubelet), flush=True)
    gateway = next(p for p in kubelet.pods.values() if p.plan.component == "gateway")
    gateway_addr = f"{gateway.ip}:{gateway.plan.ports['http']}"
    result["requests"] = await asyncio.to_thread(serve_requests, gateway_addr)
    result["engines"], failures = await asyncio.to_thread(
        deployed_engines, kubelet, result["make_serve"]["engine"]
    )
    result["redis"], redis_failures = await asyncio.to_thread(redis_in_use, kubelet)
    result["failures"] += failures + redis_failures
    return gateway_addr, result["requests"]["chat"]["model"]


async def compare_throughput(
    args: argparse.Namespace, served_url: str, deployed_url: str, llm: str, result: dict[str, Any]
) -> None:
    """`vllm bench serve` against `make serve` and the deployment, both up, in alternating
    rounds; the medians, their ratios and any ratio under MIN_THROUGHPUT_RATIO into `result`."""
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    urls = {"make_serve": served_url, "deployed": deployed_url}
    runs = await asyncio.to_thread(
        served.alternating_rounds, args.vllm, urls, llm, str(args.model_dir), concurrencies,
        args.min_prompts, args.rounds,
    )  # fmt: skip
    medians = median_table(runs, "side", list(urls), concurrencies)
    result["throughput"] = {"rounds": args.rounds, "medians": medians, "runs": runs}
    result["deployed_over_make_serve"] = served.ratios(medians)
    result["failures"] += throughput_failures(result["deployed_over_make_serve"])


async def check(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    rendered = render(yaml.safe_load(args.values.read_text()), release=RELEASE, namespace=NAMESPACE)
    plans = plan_pods(rendered)
    images = image_report(plans)
    problems = [p for i in images.values() for p in i["problems"]]
    assert not problems, problems
    kubelet = Kubelet(rendered, plans, args.pause_image)
    kubelet.teardown()
    kubelet.stopping = False
    result: dict[str, Any] = {
        "commit": commit(),
        "host": {"cpus": os.cpu_count(), "load_average_at_start": [round(x, 1) for x in os.getloadavg()]},
        "values": str(args.values.relative_to(ROOT)),
        "images": images,
        "failures": [],
    }
    print("make serve on this host, for comparison", flush=True)
    decoders = sum(1 for plan in plans if plan.component == "decoder")
    loop: asyncio.Task[None] | None = None
    try:
        with served.make_serve(args.model_dir, decoders) as mesh:
            result["make_serve"] = mesh.report()
            kubelet.start()
            loop = asyncio.create_task(kubelet.run())
            gateway_addr, llm = await deployed_and_served(kubelet, args, result)
            first_ready = {
                p.plan.name: round(p.ready_at - p.started_at, 1) for p in kubelet.pods.values() if p.ready_at
            }
            await compare_throughput(args, mesh.url, f"http://{gateway_addr}", llm, result)
        result["kill"] = await kill_mid_stream(kubelet, gateway_addr, llm)
        print(table(kubelet), flush=True)
        result.update(pod_report(kubelet, first_ready))
        result["events"] = kubelet.events
    finally:
        kubelet.stopping = True
        if loop is not None:
            loop.cancel()
        if not args.keep:
            kubelet.teardown()
    result["total_s"] = round(time.monotonic() - began, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=Path, default=VALUES)
    parser.add_argument("--pause-image", default="meshserve-base:py3.11-bookworm")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for every pod to be Ready")
    parser.add_argument("--keep", action="store_true", help="leave the pods running")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="the model `make serve` serves")
    parser.add_argument(
        "--vllm", default=os.environ.get("VLLM", "vllm"), help="the `vllm` command (bench client)"
    )
    parser.add_argument("--concurrency", default="8,32", help="vllm bench serve concurrencies")
    parser.add_argument("--min-prompts", type=int, default=64, help="prompts per run: max(this, 4 x c)")
    parser.add_argument("--rounds", type=int, default=3, help="benchmark rounds per side (medians compared)")
    args = parser.parse_args(argv)
    if shutil.which(args.vllm) is None:
        parser.error(
            f"no vllm command {args.vllm!r}: install vLLM's client (`make vllm-client`) or pass --vllm"
        )
    result = asyncio.run(check(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if result["failures"]:
        print("deploy-check FAILED:\n  " + "\n  ".join(result["failures"]), file=sys.stderr)
        return 1
    print(f"deploy-check passed in {result['total_s']} s: {args.out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
