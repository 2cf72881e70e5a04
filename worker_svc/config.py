"""Worker process configuration."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from services.config import DEFAULT_PORTS, ServerConfig, at_least, opt, positive
from services.kv_contract import SUBSCRIBER_POLL_INTERVAL_MS
from services.worker_roles import ROLES
from worker_svc.engine.config import EngineConfig, default_dtype


@dataclass(frozen=True)
class WorkerConfig(ServerConfig):
    """A model worker: which model, which role, how big its KV cache is, whom it reports to.

    `engine` holds the engine's settings; each of its fields is a flag and MESHSERVE_*
    variable of its own (`--max-num-seqs`, `--kv-cache-memory-mb`, `--engine-priority`...).
    """

    port: int = opt(DEFAULT_PORTS["decoder"], "the gRPC port")
    served_model_name: str = opt("", "the model's name in the API (default: the model directory's name)")
    role: str = opt("decoder", "what this worker serves: " + ", ".join(ROLES))
    worker_id: str = opt("", "this worker's id at the scheduler (default: ROLE-HOST-RANDOM)")
    advertise_address: str = opt(
        "", "the address the scheduler dials to reach this worker (default: host:port)"
    )
    scheduler_address: str = opt("", "scheduler(s) to register with, host:port[,host:port]")
    redis_url: str = opt("", "Redis for KV events (the scheduler's prefix index); empty: none published")
    num_threads: int = opt(
        0,
        "torch threads of the forward (0: as many as this process's CPU affinity and cgroup CPU quota allow)",
    )
    stream_interval: int = opt(
        1,
        "stream every N-th token per sequence after the first (1: every token); larger values "
        "send fewer, bigger messages through the mesh (more throughput on a busy machine, "
        "burstier inter-token latency); the first token and the end always go at once",
    )
    kv_events_flush_ms: int = opt(
        SUBSCRIBER_POLL_INTERVAL_MS,
        "KV events are gathered this long and written to Redis in one transaction "
        "(worker_svc.kv_events; 0: after every engine step); by default as long as the "
        "scheduler waits between two reads of them",
    )
    enable_runtime_lora_updating: bool = opt(
        False, "LoadLora/UnloadLora may change the adapters at run time (the gateway's admin endpoints)"
    )
    encoder_cache_address: str = opt(
        "",
        "encoder cache (host:port) where encoder workers put image embeddings and decoders "
        "fetch them; empty: this worker takes no images",
    )
    encoder_cache_timeout_s: float = opt(
        10.0, "deadline of each encoder cache call (a cache that is down fails fast, never hangs)"
    )
    kv_transfer_timeout_s: float = opt(
        30.0,
        "P/D, decoder role: deadline of one hand-off (prefill call + pull); past it the decoder prefills itself",
    )
    engine: EngineConfig = dataclasses.field(kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine.dtype == "auto":  # resolved here so every role gets a concrete dtype
            resolved = dataclasses.replace(self.engine, dtype=default_dtype(self.engine.device))
            object.__setattr__(self, "engine", resolved)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        at_least(self, 1, "stream_interval")
        at_least(self, 0, "kv_events_flush_ms")
        positive(self, "kv_transfer_timeout_s")
        positive(self, "encoder_cache_timeout_s")
        if self.role == "encoder" and not self.encoder_cache_address:
            raise ValueError("the encoder role needs --encoder-cache-address (where it stores embeddings)")

    @property
    def model_dir(self) -> str:
        """The model directory (the engine's --model-dir, also read by the other roles)."""
        return self.engine.model_dir

    @property
    def model_name(self) -> str:
        """The name clients use in `model`: --served-model-name or the directory's name."""
        return self.served_model_name or os.path.basename(os.path.normpath(self.model_dir))
