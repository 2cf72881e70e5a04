"""Worker process configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.config import ServerConfig
from services.kv_contract import SUBSCRIBER_POLL_INTERVAL_MS
from services.worker_roles import ROLES
from worker_svc.engine.config import THREAD_PRIORITIES, EngineConfig, default_dtype, parse_cpu_list


@dataclass(frozen=True)
class WorkerConfig(ServerConfig):
    """A model worker: which model, which role, how big its KV cache is, whom it reports to."""

    port: int = 50061
    model_dir: str = ""
    served_model_name: str = ""
    role: str = "decoder"
    worker_id: str = ""
    # Address the scheduler should dial to reach this worker (default host:port).
    advertise_address: str = ""
    scheduler_address: str = ""
    redis_url: str = ""
    block_size: int = 16
    num_kv_blocks: int = 0
    kv_cache_memory_mb: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 0
    enable_prefix_caching: bool = True
    # "auto": a request's unset sampling fields take the model's generation_config.json
    # defaults (vLLM's --generation-config auto); "vllm": the engine's own defaults.
    generation_config: str = "auto"
    # "auto": bfloat16 on CUDA and on CPUs with native bf16 (avx512_bf16/AMX), else float32;
    # resolved here so every role (decoder, encoder) gets a concrete dtype.
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "auto"
    num_threads: int = 0
    # torch.compile the decoder's forward (dynamic batch; the first steps compile, ~0.5-2 min on CPU).
    compile_model: bool = False
    # Decode steps replay CUDA graphs on CUDA (no-op on CPU; EngineConfig.cuda_graphs).
    cuda_graphs: bool = EngineConfig.cuda_graphs
    # CPUs for the engine's step thread, e.g. "0" or "0-1,4" (empty: not pinned).
    cpu_affinity: str = ""
    # Scheduling class of the engine's step thread and its OpenMP workers: "idle"
    # (SCHED_IDLE: the worker's event loop, and relays sharing its CPUs, preempt the
    # forward at once), "normal", or "auto" (idle on CPU, normal on CUDA). Idle starves
    # the engine under a CPU-bound neighbour on the same CPUs and cgroup (EngineConfig).
    engine_priority: str = "auto"
    # Stream every N-th token per sequence after the first (1 = every token). Larger
    # values send fewer, bigger messages through the mesh: more throughput on a busy
    # machine, burstier inter-token latency. The first token and the end always go at once.
    stream_interval: int = 1
    # KV events (the scheduler's prefix index) are gathered this long and written to Redis
    # in one transaction (worker_svc.kv_events); 0 writes after every engine step. By
    # default as long as the scheduler waits between two reads of them.
    kv_events_flush_ms: int = SUBSCRIBER_POLL_INTERVAL_MS
    # LoRA (decoder role): adapters resident at once (0: LoRA off), their largest rank,
    # loaded adapters kept in CPU memory (0: max_loras), adapters loaded at start
    # ("name=path,name=path"; vLLM's --lora-modules), and whether LoadLora/UnloadLora
    # may change them at run time (the gateway's admin-only load/unload endpoints).
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    lora_modules: tuple[str, ...] = ()
    enable_runtime_lora_updating: bool = False
    # Encoder cache (host:port) where encoder workers put image embeddings and decoder
    # workers fetch them by identifier; empty = this worker takes no images.
    encoder_cache_address: str = ""
    # Deadline of each encoder cache call (a cache that is down fails fast, never hangs).
    encoder_cache_timeout_s: float = 10.0
    # P/D disaggregation. Prefill role: seconds its prompt KV stays held when no decode
    # worker pulls or releases it. Decoder role: deadline of one hand-off (prefill call +
    # pull); past it the decoder prefills the prompt itself.
    kv_transfer_ttl_s: float = 30.0
    kv_transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", default_dtype(self.device))
        parse_cpu_list(self.cpu_affinity)
        if self.engine_priority not in THREAD_PRIORITIES:
            raise ValueError(
                f"engine_priority must be one of {', '.join(THREAD_PRIORITIES)}, got {self.engine_priority!r}"
            )
        if not self.model_dir:
            raise ValueError("model_dir is required (--model-dir)")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be > 0")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        if self.kv_events_flush_ms < 0:
            raise ValueError("kv_events_flush_ms must be >= 0")
        if self.kv_transfer_ttl_s <= 0 or self.kv_transfer_timeout_s <= 0:
            raise ValueError("kv_transfer_ttl_s and kv_transfer_timeout_s must be > 0")
        if self.encoder_cache_timeout_s <= 0:
            raise ValueError("encoder_cache_timeout_s must be > 0")
        if self.role == "encoder" and not self.encoder_cache_address:
            raise ValueError("the encoder role needs --encoder-cache-address (where it stores embeddings)")

    @property
    def model_name(self) -> str:
        """The name clients use in `model`: --served-model-name or the directory's name."""
        return self.served_model_name or os.path.basename(os.path.normpath(self.model_dir))
