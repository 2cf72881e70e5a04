"""meshserve decoder engine: continuous batching over a paged KV cache (no gRPC here).

Layers, bottom up: ``services.kv_hash`` (block hash scheme) -> ``block_manager``
(paged blocks + prefix cache + KV events) -> ``scheduler`` (token-budget, chunked
prefill, preemption) -> ``model_runner`` + ``attention`` (transformers model with a
paged attention function; ``arch``: per-layer attention properties -- sliding windows,
softcap, sinks -- and the load-time refusal of models we cannot serve exactly;
``cpu_attention``: the native CPU decode kernel, ``native`` builds ``csrc/``) ->
``sampling`` (+ ``structured``: grammar bitmasks; ``cpu_sampling``: the native draw) -> ``engine`` (sync step loop) ->
``async_engine`` (asyncio front with a dedicated engine thread). ``multimodal``: the
language-model-only load of vision-language checkpoints and image-embedding merging.
``lora``: PEFT LoRA adapters on the projections, batched per slot.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker_svc.engine.async_engine import AsyncLLMEngine
    from worker_svc.engine.block_manager import BlockManager, KvEvent
    from worker_svc.engine.config import EngineConfig
    from worker_svc.engine.engine import EngineStats, EngineStepError, LLMEngine, RequestOutput
    from worker_svc.engine.model_runner import ModelInfo
    from worker_svc.engine.multimodal import MultiModalInput
    from worker_svc.engine.request import Request, RequestSpec, RequestStatus
    from worker_svc.engine.sampling import SamplingParams

# Loaded on first use: `worker_svc.engine.config` (read by the launcher and the worker's
# flags) must not pull in torch.
_EXPORTS = {
    "AsyncLLMEngine": "worker_svc.engine.async_engine",
    "BlockManager": "worker_svc.engine.block_manager",
    "KvEvent": "worker_svc.engine.block_manager",
    "EngineConfig": "worker_svc.engine.config",
    "EngineStats": "worker_svc.engine.engine",
    "EngineStepError": "worker_svc.engine.engine",
    "LLMEngine": "worker_svc.engine.engine",
    "RequestOutput": "worker_svc.engine.engine",
    "ModelInfo": "worker_svc.engine.model_runner",
    "MultiModalInput": "worker_svc.engine.multimodal",
    "Request": "worker_svc.engine.request",
    "RequestSpec": "worker_svc.engine.request",
    "RequestStatus": "worker_svc.engine.request",
    "SamplingParams": "worker_svc.engine.sampling",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = [
    "AsyncLLMEngine",
    "BlockManager",
    "EngineConfig",
    "EngineStats",
    "EngineStepError",
    "KvEvent",
    "LLMEngine",
    "ModelInfo",
    "MultiModalInput",
    "Request",
    "RequestOutput",
    "RequestSpec",
    "RequestStatus",
    "SamplingParams",
]
