"""Engine configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ATTENTION_BACKENDS", "DTYPES", "EngineConfig"]

DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("torch", "triton", "auto")


@dataclass(frozen=True)
class EngineConfig:
    """Static configuration of one :class:`LLMEngine`.

    ``num_kv_blocks=None`` sizes the paged KV cache from ``kv_cache_memory_bytes``;
    ``max_model_len=None`` takes the model's ``max_position_embeddings``.
    ``max_num_batched_tokens`` is the per-step token budget shared by decodes and
    (chunked) prefills.
    """

    model_dir: str
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"

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
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )


def _positive_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a block size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
