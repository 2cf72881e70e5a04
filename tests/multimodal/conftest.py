"""Fixtures of the multimodal tests: the tiny LLaVA-style model (devtools.build_vlm), its
stock transformers reference, and helpers to make images and reference inputs."""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, LlavaForConditionalGeneration

from devtools.build_vlm import VlmSpec, build
from services.image_preprocess import ImagePreprocessor

QUESTION = "What is in this picture?"


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny VLM (built in-process, ~5 s), or MESHSERVE_TEST_VLM_DIR when set."""
    configured = os.environ.get("MESHSERVE_TEST_VLM_DIR")
    if configured:
        return Path(configured)
    out = tmp_path_factory.mktemp("models") / "tiny-vlm"
    build(VlmSpec(out=out, seed=0, image_size=32, patch_size=8, init_std=0.1))
    return out


@pytest.fixture(scope="session")
def hf_vlm(vlm_dir: Path) -> LlavaForConditionalGeneration:
    """The whole model with stock transformers attention: the non-disaggregated reference."""
    return LlavaForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()


def png_bytes(seed: int, width: int = 40, height: int = 30) -> bytes:
    """A random RGB PNG image."""
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(png: bytes) -> str:
    """A ``data:image/png;base64,...`` URL for OpenAI ``image_url`` parts."""
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat_messages(png: bytes, text: str = QUESTION) -> list[dict[str, Any]]:
    """One user turn with a text part and an image part."""
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(png)}}]
    return [{"role": "user", "content": content}]


@dataclass
class Reference:
    """The prompt as the mesh renders it, and what a single process computes from it."""

    prompt: list[int]
    image_offset: int
    pixel_values: torch.Tensor  # [1, 3, H, W]


class ReferenceBuilder:
    """Builds prompts and pixel values the way a user of plain transformers would."""

    def __init__(self, vlm_dir: Path, model: LlavaForConditionalGeneration) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
        self.preprocess = ImagePreprocessor.from_model_dir(vlm_dir)
        self.model = model
        self.image_token = int(model.config.image_token_id)
        self.seq_length = int(model.config.image_seq_length)

    def reference(self, png: bytes, text: str = QUESTION) -> Reference:
        """Chat template → token ids with the image token expanded; image → pixel values."""
        ids = self.tokenizer.apply_chat_template(
            chat_messages(png, text), add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        at = ids.index(self.image_token)
        prompt = [*ids[:at], *[self.image_token] * self.seq_length, *ids[at + 1 :]]
        image = Image.open(io.BytesIO(png)).convert("RGB")
        assert self.preprocess is not None
        pixels = self.preprocess(image.tobytes(), image.width, image.height)
        return Reference(prompt, at, torch.from_numpy(pixels)[None])

    def embeddings(self, ref: Reference) -> torch.Tensor:
        """The image's embeddings: vision tower + projector ([seq_length, hidden])."""
        with torch.inference_mode():
            features = self.model.model.get_image_features(pixel_values=ref.pixel_values).pooler_output
        return torch.cat(list(features)).float()

    def greedy(self, ref: Reference, max_new_tokens: int) -> list[int]:
        """transformers ``generate`` on the full model with pixel values (do_sample=False)."""
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=torch.tensor([ref.prompt]),
                attention_mask=torch.ones(1, len(ref.prompt), dtype=torch.long),
                pixel_values=ref.pixel_values,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return [int(t) for t in out[0, len(ref.prompt) :]]


@pytest.fixture(scope="session")
def refs(vlm_dir: Path, hf_vlm: LlavaForConditionalGeneration) -> ReferenceBuilder:
    return ReferenceBuilder(vlm_dir, hf_vlm)
