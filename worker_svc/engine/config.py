"""Engine configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.config import opt, required
from services.kv_contract import DEFAULT_BLOCK_SIZE

__all__ = [
    "ATTENTION_BACKENDS",
    "DTYPES",
    "SWITCHES",
    "THREAD_PRIORITIES",
    "EngineConfig",
    "cpu_flags",
    "default_dtype",
    "parse_cpu_list",
    "parse_lora_modules",
    "resolved_thread_priority",
]

DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("torch", "sdpa", "triton", "cpu", "auto")
THREAD_PRIORITIES = ("auto", "normal", "idle")
SWITCHES = ("auto", "on", "off")  # a feature's setting: auto decides per device
GENERATION_CONFIGS = ("auto", "vllm")


@dataclass(frozen=True)
class EngineConfig:
    """Static configuration of one :class:`LLMEngine`; each field's help says what it sets.

    The worker's flags and ``MESHSERVE_*`` variables of the same names set these fields
    (``worker_svc.config.WorkerConfig.engine``); in-process callers build one directly.
    """

    model_dir: str = required("the model: a Hugging Face model directory (required)")
    block_size: int = opt(
        DEFAULT_BLOCK_SIZE, "tokens per KV-cache block (the scheduler's --block-size must agree)"
    )
    num_kv_blocks: int = opt(0, "KV-cache blocks (0: as many as --kv-cache-memory-mb holds)")
    kv_cache_memory_mb: int = opt(256, "the KV cache's size in MiB (when --num-kv-blocks is 0)")
    max_num_seqs: int = opt(64, "the most sequences in one engine step (running at once)")
    max_num_batched_tokens: int = opt(
        512, "the per-step token budget shared by decodes and (chunked) prefills"
    )
    max_model_len: int = opt(
        0, "the longest sequence, prompt plus output (0: the model's max_position_embeddings)"
    )
    enable_prefix_caching: bool = opt(True, "reuse the KV blocks of an earlier identical prompt prefix")
    kv_tier_mb: int = opt(
        0,
        "a second KV tier in MiB below the cache, in a memory-mapped file: blocks the cache "
        "evicts after repeated use go there and a prefix found there is loaded, not computed "
        "(worker_svc/engine/kv_tier.py); 0: none",
    )
    kv_tier_path: str = opt("", "the KV tier's file (empty: an unlinked temp file)")
    kv_tier_admit_after: int = opt(
        2, "uses (computed or reused) a block needs before an eviction stores it in the KV tier"
    )
    dtype: str = opt(
        "auto",
        "weights and KV cache: " + ", ".join(DTYPES) + "; auto: bfloat16 on CUDA and on CPUs with "
        "native bf16 (avx512_bf16/AMX), else float32",
    )
    device: str = opt("cpu", "cpu or cuda[:N]")
    attention_backend: str = opt("auto", "paged attention kernels: " + ", ".join(ATTENTION_BACKENDS))
    compile_model: bool = opt(
        True,
        "torch.compile the text-only forward before the worker reports ready (1-3 min at start "
        "on 2 cores); on CUDA the decode graphs capture the compiled forward",
    )
    merge_projections: str = opt(
        "auto",
        "on: each layer's q/k/v projections, and its MLP's gate/up, run as one matmul over "
        "their stacked weights (worker_svc/engine/merged_projections.py); off: the "
        "checkpoint's separate projections; auto: on on CUDA (a GEMM of a few rows is mostly "
        "its fixed cost there), off on CPU (no faster, docs/design-decisions.md)",
    )
    cpu_affinity: str = opt(
        "", "CPUs the engine's step thread is pinned to, e.g. 0 or 0-1,4 (empty: not pinned)"
    )
    engine_priority: str = opt(
        "auto",
        "scheduling class of the engine's step thread and its OpenMP workers: idle (SCHED_IDLE: "
        "any other runnable thread on their CPUs, e.g. the worker's event loop, preempts them at "
        "once; a CPU-bound neighbour on the same CPUs and cgroup starves them), normal, or auto "
        "(idle on CPU, normal on CUDA); see resolved_thread_priority",
    )
    priority_step_ratio: float = opt(
        2.0,
        "while requests of more than one priority run, lower priorities' rows and prompt chunks "
        "take only as many tokens as keep a step within this multiple of what the highest "
        "priority's rows alone take (from the engine's measured step times): its requests' "
        "tokens beside a flood of lower priority come at short steps; 0: no cap",
    )
    generation_config: str = opt(
        "auto",
        "auto: a request's unset sampling fields take the model's generation_config.json defaults "
        "(vLLM's --generation-config auto); vllm: the engine's own defaults",
    )
    cuda_graphs: bool = opt(
        True,
        "on CUDA, decode-only steps replay a CUDA graph captured per batch-size bucket "
        "(worker_svc.engine.cuda_graphs); other steps, and every step on CPU, run eagerly",
    )
    async_scheduling: str = opt(
        "auto",
        "on: while a step's tokens are sampled on the device, the next step is scheduled and "
        "launched, its rows' inputs taken from those tokens there (vLLM's async scheduling); "
        "steps with a request whose draw reads its output's tokens on the host (bad words, "
        "grammars) still wait; "
        "off: every step is read back before the next is scheduled; auto: on on CUDA",
    )
    kv_transfer_ttl_s: float = opt(
        30.0,
        "P/D: seconds a prefill-only request's KV stays held for its transfer when no decode "
        "worker pulls or releases it (one that died mid-hand-off)",
    )
    max_loras: int = opt(0, "LoRA adapters resident at once (0: LoRA off)")
    max_lora_rank: int = opt(16, "the largest LoRA rank accepted")
    max_cpu_loras: int = opt(0, "loaded LoRA adapters kept in CPU memory (0: max_loras)")
    lora_modules: tuple[str, ...] = opt(
        (), "LoRA adapters loaded at start, name=path,name=path (vLLM's --lora-modules; lora.py)"
    )

    def __post_init__(self) -> None:
        if isinstance(self.model_dir, os.PathLike):
            object.__setattr__(self, "model_dir", os.fspath(self.model_dir))
        if not isinstance(self.model_dir, str) or not self.model_dir:
            raise ValueError("model_dir must be a non-empty path")
        _positive_int("block_size", self.block_size)
        if self.block_size > 1024:
            raise ValueError(f"block_size must be <= 1024, got {self.block_size}")
        _non_negative_int("num_kv_blocks", self.num_kv_blocks)
        _positive_int("kv_cache_memory_mb", self.kv_cache_memory_mb)
        if self.kv_tier_mb < 0 or self.kv_tier_admit_after < 1:
            raise ValueError("kv_tier_mb must be >= 0 and kv_tier_admit_after >= 1")
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _non_negative_int("max_model_len", self.max_model_len)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching must be a bool")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not isinstance(self.compile_model, bool):
            raise ValueError("compile_model must be a bool")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError("cuda_graphs must be a bool")
        if self.priority_step_ratio != 0 and not self.priority_step_ratio > 1:
            raise ValueError(f"priority_step_ratio must be 0 (no cap) or > 1, got {self.priority_step_ratio}")
        parse_cpu_list(self.cpu_affinity)
        if self.engine_priority not in THREAD_PRIORITIES:
            raise ValueError(
                f"engine_priority must be one of {THREAD_PRIORITIES}, got {self.engine_priority!r}"
            )
        for name in ("async_scheduling", "merge_projections"):
            if getattr(self, name) not in SWITCHES:
                raise ValueError(f"{name} must be one of {SWITCHES}, got {getattr(self, name)!r}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(
                f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}"
            )
        if not self.kv_transfer_ttl_s > 0:
            raise ValueError(f"kv_transfer_ttl_s must be > 0, got {self.kv_transfer_ttl_s!r}")
        self._check_lora()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )

    def _check_lora(self) -> None:
        _non_negative_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        _non_negative_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        modules = parse_lora_modules(self.lora_modules)
        if modules and not self.max_loras:
            raise ValueError("lora_modules needs max_loras >= 1")

    def merges_projections(self, device: str) -> bool:
        """Whether ``merge_projections`` is on for the engine's ``device`` (auto: on CUDA)."""
        return self.merge_projections == "on" or (
            self.merge_projections == "auto" and device.startswith("cuda")
        )

    def compile_skipped(self) -> str:
        """Why the forward runs eagerly ("" when it compiles): ``compile_model`` off."""
        return "" if self.compile_model else "compile_model off"

    @property
    def compiles(self) -> bool:
        """Whether the model's forward is compiled (nothing skips it)."""
        return not self.compile_skipped()

    @property
    def cpu_lora_capacity(self) -> int:
        """Adapters kept loaded in CPU memory (``max_cpu_loras``, at least ``max_loras``)."""
        return max(self.max_cpu_loras, self.max_loras)


def parse_lora_modules(modules: tuple[str, ...]) -> dict[str, str]:
    """``("name=path", ...)`` -> {name: path}; ValueError names a malformed or repeated entry."""
    if not isinstance(modules, tuple):
        raise ValueError(f"lora_modules must be a tuple of 'name=path' strings, got {modules!r}")
    out: dict[str, str] = {}
    for entry in modules:
        name, sep, path = entry.partition("=") if isinstance(entry, str) else ("", "", "")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules entry {entry!r} is not 'name=path'")
        if name.strip() in out:
            raise ValueError(f"lora_modules names adapter {name.strip()!r} twice")
        out[name.strip()] = path.strip()
    return out


def resolved_thread_priority(config: EngineConfig) -> str:
    """ "idle" or "normal": what ``config.engine_priority`` means on its device.

    Why idle on CPU: the forward's OpenMP threads fill every CPU they are given and wait
    for each other at every barrier, while the processes that carry its tokens (the
    worker's event loop, the gateway, the client) wake for a fraction of a millisecond
    per step. At normal priority the kernel (EEVDF) often lets a woken one wait for the
    next tick behind a forward thread; at SCHED_IDLE it preempts the forward at once
    (docs/design-decisions.md, "Engine threads at idle priority on CPU"). The price: the
    engine gets only what the other
    threads on its CPUs leave, so a CPU-bound neighbour on the same CPUs and in the same
    cgroup starves it -- give it CPUs of its own, or "normal". On CUDA the step thread
    launches kernels and must not wait behind anything: normal."""
    if config.engine_priority != "auto":
        return config.engine_priority
    return "idle" if config.device.split(":")[0] == "cpu" else "normal"


def _positive_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a block size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def default_dtype(device: str, cpu_flags: frozenset[str] | None = None) -> str:
    """bfloat16 on CUDA and on CPUs with native bf16 dot products (avx512_bf16 or AMX),
    float32 elsewhere (emulated bf16 matmuls are slower than float32 ones).
    ``cpu_flags`` defaults to this machine's (``/proc/cpuinfo``)."""
    if device.split(":")[0] == "cuda":
        return "bfloat16"
    flags = _host_flags() if cpu_flags is None else cpu_flags
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "float32"


def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (``/proc/cpuinfo``); empty where unknown."""
    return _host_flags()


def _host_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (frozenset(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                frozenset(),
            )
    except OSError:  # not Linux: no cheap way to know, stay exact (float32)
        return frozenset()


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5}; empty -> empty set. ValueError names the bad part."""
    if not isinstance(text, str):
        raise ValueError(f"cpu_affinity must be a string like '0-1,3', got {text!r}")
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())) or (sep and int(hi) < int(lo)):
            raise ValueError(f"cpu_affinity: bad CPU range {part!r} in {text!r}")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return frozenset(cpus)
