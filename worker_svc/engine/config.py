"""Engine configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "ATTENTION_BACKENDS",
    "DTYPES",
    "THREAD_PRIORITIES",
    "EngineConfig",
    "cpu_flags",
    "default_dtype",
    "parse_cpu_list",
    "resolved_thread_priority",
]

DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("torch", "sdpa", "triton", "cpu", "auto")
THREAD_PRIORITIES = ("auto", "normal", "idle")
GENERATION_CONFIGS = ("auto", "vllm")


@dataclass(frozen=True)
class EngineConfig:
    """Static configuration of one :class:`LLMEngine`.

    ``num_kv_blocks=None`` sizes the paged KV cache from ``kv_cache_memory_bytes``;
    ``max_model_len=None`` takes the model's ``max_position_embeddings``.
    ``max_num_batched_tokens`` is the per-step token budget shared by decodes and
    (chunked) prefills. ``dtype="auto"`` is :func:`default_dtype` of the device.
    ``compile_model`` runs text-only forward passes through ``torch.compile`` (dynamic
    batch; the first steps of each new shape class pay the compile time).
    ``cpu_affinity`` (e.g. ``"0"`` or ``"0-1,4"``; empty = no pinning) pins the thread
    that runs ``step()`` to those CPUs.
    ``generation_config``: ``"auto"`` takes the sampling defaults of the model's
    ``generation_config.json`` for the fields a request leaves unset (vLLM's
    ``--generation-config auto``); ``"vllm"`` ignores them (the engine's own defaults).
    ``thread_priority`` is the scheduling class of :class:`AsyncLLMEngine`'s step thread
    and its OpenMP workers: ``"idle"`` (Linux ``SCHED_IDLE``: any other runnable thread
    on their CPUs takes the CPU from them at once), ``"normal"``, or ``"auto"`` (idle on
    CPU, normal on CUDA). See :func:`resolved_thread_priority`.
    ``cuda_graphs``: on CUDA, decode-only steps replay a CUDA graph captured per batch-size
    bucket (:mod:`worker_svc.engine.cuda_graphs`); other steps, and every step on CPU, run
    eagerly.
    """

    model_dir: str
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "auto"
    compile_model: bool = False
    cpu_affinity: str = ""
    thread_priority: str = "auto"
    generation_config: str = "auto"
    cuda_graphs: bool = True
    # Seconds a prefill-only request's KV stays pinned for its transfer when nobody pulls
    # or releases it (a decode worker that died mid-hand-off).
    kv_transfer_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.model_dir, os.PathLike):
            object.__setattr__(self, "model_dir", os.fspath(self.model_dir))
        if not isinstance(self.model_dir, str) or not self.model_dir:
            raise ValueError("model_dir must be a non-empty path")
        _positive_int("block_size", self.block_size)
        if self.block_size > 1024:
            raise ValueError(f"block_size must be <= 1024, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
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
        parse_cpu_list(self.cpu_affinity)
        if self.thread_priority not in THREAD_PRIORITIES:
            raise ValueError(
                f"thread_priority must be one of {THREAD_PRIORITIES}, got {self.thread_priority!r}"
            )
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(
                f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}"
            )
        if not self.kv_transfer_ttl_s > 0:
            raise ValueError(f"kv_transfer_ttl_s must be > 0, got {self.kv_transfer_ttl_s!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )


def resolved_thread_priority(config: EngineConfig) -> str:
    """ "idle" or "normal": what ``config.thread_priority`` means on its device.

    Why idle on CPU: the forward's OpenMP threads fill every CPU they are given and wait
    for each other at every barrier, while the processes that carry its tokens (the
    worker's event loop, the gateway, the client) wake for a fraction of a millisecond
    per step. At normal priority the kernel (EEVDF) often lets a woken one wait for the
    next tick, up to 4 ms, behind a forward thread; at SCHED_IDLE it preempts the forward
    at once (docs/design-decisions.md, "Engine threads at idle priority on CPU"). The price: the engine gets only what the other
    threads on its CPUs leave, so a CPU-bound neighbour on the same CPUs and in the same
    cgroup starves it -- give it CPUs of its own, or "normal". On CUDA the step thread
    launches kernels and must not wait behind anything: normal."""
    if config.thread_priority != "auto":
        return config.thread_priority
    return "idle" if config.device.split(":")[0] == "cpu" else "normal"


def _positive_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a block size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


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
