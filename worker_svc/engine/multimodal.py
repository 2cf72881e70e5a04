"""Multimodal support of the engine: decoder-side loading of vision-language checkpoints
and merging of precomputed image embeddings into prefill chunks.

A LLaVA-style checkpoint (``config.json`` with ``vision_config`` and ``text_config``) is
loaded by the decoder as its *language model only*: ``AutoModelForCausalLM`` built from
``text_config``, with the checkpoint's ``model.language_model.*`` (or legacy
``language_model.model.*``) weights renamed onto it. The vision tower and projector
weights are never read -- they belong to the encoder workers -- and the language model's
layers run with the paged attention like any text model.

A request carries its images as :class:`MultiModalInput` (placeholder ``offset``,
``length`` and the ``[length, hidden_size]`` embeddings). When a step's chunk covers
placeholder positions, the runner replaces those rows of the token embeddings and calls
the model with ``inputs_embeds``; steps without image rows keep the plain ``input_ids``
path.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worker_svc.engine.host_copy import pinned_to, tensor_on

__all__ = [
    "MultiModalInput",
    "is_multimodal_checkpoint",
    "load_causal_lm",
    "merge_mm_rows",
    "mm_rows",
    "validate_mm_inputs",
]

# Checkpoint key renames that put a LLaVA-style language model onto a causal LM.
TEXT_KEY_MAPPING = {
    r"^model\.language_model\.": "model.",  # transformers >= 4.52 layout
    r"^language_model\.model\.": "model.",  # legacy llava-hf layout
    r"^language_model\.lm_head\.": "lm_head.",
}


@dataclass(frozen=True, eq=False)
class MultiModalInput:
    """One image of a prompt: its embeddings replace prompt positions ``[offset, offset + length)``."""

    identifier: str
    offset: int
    length: int
    embeddings: torch.Tensor = field(repr=False)  # [length, hidden_size]

    @property
    def end(self) -> int:
        """Position after the last placeholder."""
        return self.offset + self.length


def is_multimodal_checkpoint(model_dir: str | Path) -> bool:
    """True for a vision-language checkpoint (config with ``vision_config`` and ``text_config``)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "vision_config" in config and "text_config" in config


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silences transformers' load report (the skipped vision weights are expected)."""
    import transformers

    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(previous)


def load_causal_lm(model_dir: str, attn_implementation: str, dtype: torch.dtype) -> Any:
    """The causal LM of ``model_dir``: the whole model for a text checkpoint, only the
    language model (+ lm_head) of a vision-language checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not is_multimodal_checkpoint(model_dir):
        return AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation=attn_implementation, dtype=dtype
        )
    text_config = AutoConfig.from_pretrained(model_dir).get_text_config()
    with quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(
            model_dir,
            config=text_config,
            key_mapping=TEXT_KEY_MAPPING,
            attn_implementation=attn_implementation,
            dtype=dtype,
        )


def validate_mm_inputs(inputs: Sequence[MultiModalInput], num_prompt_tokens: int, hidden_size: int) -> None:
    """ValueError naming the item when an input lies outside the prompt, overlaps another
    or has embeddings of the wrong shape."""
    if not all(isinstance(item, MultiModalInput) for item in inputs):
        raise ValueError("mm_inputs must be MultiModalInput objects")
    last_end = 0
    for i, item in enumerate(sorted(inputs, key=lambda m: m.offset)):
        name = f"mm_items[{i}] ({item.identifier})"
        if item.length <= 0 or item.offset < 0 or item.end > num_prompt_tokens:
            raise ValueError(
                f"{name}: placeholders [{item.offset}, {item.end}) lie outside the prompt of {num_prompt_tokens} tokens"
            )
        if item.offset < last_end:
            raise ValueError(f"{name}: placeholders overlap the previous item")
        if tuple(item.embeddings.shape) != (item.length, hidden_size):
            raise ValueError(
                f"{name}: embeddings have shape {list(item.embeddings.shape)}, expected [{item.length}, {hidden_size}]"
            )
        last_end = item.end


def mm_rows(
    chunks: Sequence[tuple[int, int, int, Sequence[MultiModalInput]]],
) -> tuple[list[int], list[torch.Tensor]]:
    """Packed rows that hold image positions, and their embeddings, for chunks given as
    ``(first_packed_row, start_position, end_position, inputs)``."""
    rows: list[int] = []
    values: list[torch.Tensor] = []
    for row0, start, end, inputs in chunks:
        for item in inputs:
            lo, hi = max(start, item.offset), min(end, item.end)
            if lo >= hi:
                continue
            rows.extend(range(row0 + lo - start, row0 + hi - start))
            values.append(item.embeddings[lo - item.offset : hi - item.offset])
    return rows, values


def merge_mm_rows(embeds: torch.Tensor, rows: list[int], values: list[torch.Tensor]) -> torch.Tensor:
    """``embeds`` ([1, T, H] token embeddings) with ``rows`` replaced by ``values`` (in place)."""
    index = tensor_on(rows, embeds.device, torch.long)
    merged = pinned_to(torch.cat(values), embeds.device).to(embeds.dtype)  # from the request: host
    embeds[0].index_copy_(0, index, merged)
    return embeds
