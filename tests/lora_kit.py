"""PEFT LoRA adapters built at test time (random, non-zero: ``init_lora_weights=False``)
and PEFT's own greedy ``generate`` with one applied (not merged): the reference the
engine, the worker and the mesh are compared with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three adapters that differ in rank, targets, alpha and scaling rule.
ADAPTERS: dict[str, dict[str, Any]] = {
    "ad-all": {"r": 4, "lora_alpha": 8, "target_modules": ALL_PROJECTIONS},
    "ad-attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
    "ad-mlp": {"r": 2, "lora_alpha": 32, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
}


def base_model(model_dir: str | Path) -> Any:
    """The base model in float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def build_adapters(model_dir: str | Path, root: Path, names: list[str] | None = None) -> dict[str, str]:
    """Each adapter of ADAPTERS (or those named) saved by peft under ``root``; name -> dir."""
    out = {}
    for i, name in enumerate(names or list(ADAPTERS)):
        torch.manual_seed(10 + i)
        config = LoraConfig(init_lora_weights=False, **ADAPTERS[name])
        get_peft_model(base_model(model_dir), config).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate(do_sample=False)`` of one prompt (no padding)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


def peft_greedy(model_dir: str | Path, adapter_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """PEFT's greedy output with the adapter applied (PeftModel, not merged)."""
    model = PeftModel.from_pretrained(base_model(model_dir), adapter_dir).eval()
    return greedy(model, prompt, max_new_tokens)
