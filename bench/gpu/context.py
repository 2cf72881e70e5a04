"""The GPU kit's profiles (shapes and time boxes) and what a step is given (bench.gpu.kit)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PROFILES", "Profile", "Skip", "StepContext", "write_json"]


@dataclass(frozen=True)
class Profile:
    """Shapes and sizes of one kit run; ``step_s`` is each step's time box in seconds."""

    name: str
    device: str
    dtype: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_model_len: int
    prompt_len: int
    output_len: int
    concurrencies: tuple[int, ...]
    waves: int  # requests per concurrency c: c * waves (at least min_requests)
    min_requests: int
    naive_requests: int
    mesh_concurrency: int
    max_batch_tokens: int
    kv_cache_mb: int
    copy_mb: int
    budget_s: float  # the whole run; a step starts only while enough of it is left
    step_s: dict[str, float] = field(default_factory=dict)
    # bench.host_overhead within the kit: decode steps timed per concurrency.
    host_concurrencies: tuple[int, ...] = (1, 64, 256)
    host_steps: int = 100

    def num_requests(self, concurrency: int) -> int:
        return max(concurrency * self.waves, self.min_requests)


PROFILES = {
    "gpu": Profile(
        "gpu",
        "cuda",
        "bfloat16",
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        intermediate=8192,
        vocab=128256,
        max_model_len=1024,
        prompt_len=512,
        output_len=128,
        concurrencies=(1, 16, 64, 256),
        waves=2,
        min_requests=4,
        naive_requests=2,
        mesh_concurrency=64,
        max_batch_tokens=8192,
        kv_cache_mb=12288,
        copy_mb=1024,
        budget_s=530,
        # Boxes allow for the compiles of the CUDA default (compiled forward in the graphs):
        # a cold one per model and LoRA setting, the FX graph cache's warm ones after.
        step_s={
            "build": 60,
            "correctness": 110,
            "roofline": 30,
            "decode_attention": 30,
            "engine_graphs": 200,
            "c1_anatomy": 140,
            "lora_mix": 180,
            "mesh": 240,
            "host_overhead": 45,
            "skinny_gemm": 40,
            "prefill_attention": 30,
            "norm_parity": 75,
            "top_p_sampler": 30,
            "engine_eager": 100,
            "hf_naive": 45,
        },
    ),
    "cpu-dry-run": Profile(
        "cpu-dry-run",
        "cpu",
        "float32",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=512,
        max_model_len=128,
        prompt_len=16,
        output_len=4,
        concurrencies=(1, 4),
        waves=1,
        min_requests=2,
        naive_requests=1,
        mesh_concurrency=4,
        max_batch_tokens=256,
        kv_cache_mb=16,
        copy_mb=16,
        budget_s=300,
        step_s={
            "build": 60,
            "correctness": 60,
            "roofline": 30,
            "decode_attention": 30,
            "engine_graphs": 60,
            "engine_eager": 60,
            "lora_mix": 60,
            "mesh": 120,
            "hf_naive": 30,
            "c1_anatomy": 60,
            "host_overhead": 60,
            "skinny_gemm": 10,
            "prefill_attention": 10,
            "norm_parity": 10,
            "top_p_sampler": 10,
        },
        host_concurrencies=(1, 8),
        host_steps=10,
    ),
}


class Skip(Exception):
    """A step that cannot run here (e.g. CUDA graphs on CPU): recorded with its reason."""


@dataclass
class StepContext:
    """What a step gets: the profile, the work directory, its deadline (``time.time()``)
    and a record of its figures so far (written to ``part`` at every :meth:`record`, so a
    step killed at its time box still leaves the figures it had)."""

    profile: Profile
    work: Path
    deadline: float
    part: Path | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def model_dir(self) -> str:
        return str(self.work / "model")

    def left_s(self) -> float:
        return self.deadline - time.time()

    def record(self, key: str, value: Any) -> None:
        self.data[key] = value
        if self.part is not None:
            write_json(self.part, {"status": "running", **self.data})


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON at ``path``, replaced atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
