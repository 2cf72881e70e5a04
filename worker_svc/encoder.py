"""Encoder role (domain code, no grpc): the vision tower + projector of a LLaVA-style
checkpoint, turning images into the embeddings the decoder merges at the image's
placeholder positions.

Loading reads only the vision tower and projector weights: the model is built from its
config with the text model reduced to zero layers and a one-token vocabulary, and the
checkpoint's language-model weights are renamed away so they are never read. Encoding
is transformers' own image-feature path (``model.get_image_features(pixel_values=...)``:
feature layer selection, CLS handling and projector as the full model does them).

An item's payload is either preprocessed ``pixel_values`` (float, ``(3, H, W)`` or
``(1, 3, H, W)``, what the tokenizer service sends) or raw RGB pixels (uint8
``(H, W, 3)``), which are preprocessed here with the model's image processor.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.image_preprocess import ImagePreprocessor
from worker_svc.engine.multimodal import quiet_transformers

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NUMPY_FLOATS = {"float32": np.float32, "float16": np.float16, "float64": np.float64}
# Checkpoint keys of the language model, renamed to names the vision-only model lacks.
_SKIP_TEXT_WEIGHTS = {
    r"^model\.language_model\.": "unused_language_model.",
    r"^language_model\.": "unused_language_model.",
    r"^lm_head\.": "unused_lm_head.",
}


@dataclass(frozen=True)
class EncodeInput:
    """One image to encode: its payload and the number of placeholder tokens it fills."""

    identifier: str
    length: int
    dtype: str
    shape: tuple[int, ...]
    data: bytes = field(repr=False)


def tensor_bytes(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, raw bytes) of a float tensor, for the encoder cache."""
    names = {v: k for k, v in TORCH_DTYPES.items()}
    if tensor.dtype not in names:
        raise ValueError(f"cannot store a {tensor.dtype} tensor")
    flat = tensor.detach().to("cpu").contiguous()
    return names[tensor.dtype], tuple(flat.shape), flat.view(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(dtype: str, shape: Sequence[int], data: bytes) -> torch.Tensor:
    """The inverse of :func:`tensor_bytes`; ValueError when the bytes do not fit."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"unsupported embeddings dtype {dtype!r}")
    tensor = torch.frombuffer(bytearray(data), dtype=TORCH_DTYPES[dtype])
    if tensor.numel() != int(np.prod(shape)):
        raise ValueError(f"{len(data)} bytes of {dtype} do not make shape {list(shape)}")
    return tensor.reshape(tuple(shape))


def load_vision_model(model_dir: str, dtype: torch.dtype) -> Any:
    """The image-text model of ``model_dir`` with only its vision tower and projector loaded."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "vision_config", None) is None:
        raise ValueError(f"{model_dir} is not a vision-language model (its config has no vision_config)")
    text = config.get_text_config()
    text.num_hidden_layers = 0
    text.vocab_size = 1
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = []
    with quiet_transformers():
        return AutoModelForImageTextToText.from_pretrained(
            model_dir, config=config, key_mapping=_SKIP_TEXT_WEIGHTS, dtype=dtype
        )


class VisionEncoder:
    """Images → embeddings ``[num_image_tokens, text_hidden_size]`` per image."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32") -> None:
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[dtype]
        self.model: Any = load_vision_model(model_dir, self.dtype).to(self.device).eval()
        self.preprocess = ImagePreprocessor.from_model_dir(model_dir)
        self.hidden_size = int(self.model.config.get_text_config().hidden_size)

    def pixel_values(self, item: EncodeInput) -> torch.Tensor:
        """The ``(3, H, W)`` pixel values of an item; ValueError names a bad payload."""
        shape = item.shape
        if item.dtype == "uint8" and len(shape) == 3 and shape[2] == 3:
            if self.preprocess is None:
                raise ValueError(f"{item.identifier}: raw pixels need the model's preprocessor_config.json")
            return torch.from_numpy(self.preprocess(item.data, width=shape[1], height=shape[0]))
        if item.dtype not in _NUMPY_FLOATS or len(shape) not in (3, 4) or shape[-3] != 3:
            raise ValueError(
                f"{item.identifier}: expected float pixel values (3, H, W) or uint8 RGB (H, W, 3), "
                f"got {item.dtype} {list(shape)}"
            )
        array = np.frombuffer(item.data, dtype=_NUMPY_FLOATS[item.dtype])
        if array.size != int(np.prod(shape)):
            raise ValueError(
                f"{item.identifier}: {len(item.data)} bytes do not make {item.dtype} {list(shape)}"
            )
        return torch.from_numpy(array.reshape(shape[-3:]).astype(np.float32))

    def encode(self, items: Sequence[EncodeInput]) -> list[torch.Tensor]:
        """Embeddings of every item (images of one size run as one batch)."""
        pixels = [self.pixel_values(item) for item in items]
        out: list[torch.Tensor | None] = [None] * len(items)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(pixels):
            by_shape.setdefault(tuple(p.shape), []).append(i)
        for indices in by_shape.values():
            batch = torch.stack([pixels[i] for i in indices]).to(self.device, self.dtype)
            for i, features in zip(indices, self._features(batch), strict=True):
                out[i] = features
        result = [t for t in out if t is not None]
        for item, features in zip(items, result, strict=True):
            if features.shape[0] != item.length:
                raise ValueError(
                    f"{item.identifier}: the model makes {features.shape[0]} image features "
                    f"but the prompt has {item.length} placeholder tokens"
                )
        return result

    def _features(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        with torch.inference_mode():
            out = self.model.get_image_features(pixel_values=pixel_values)
        features = getattr(out, "pooler_output", out)
        if isinstance(features, torch.Tensor):
            features = list(features.reshape(pixel_values.shape[0], -1, self.hidden_size))
        return [f.reshape(-1, self.hidden_size) for f in features]
