"""Image → ``pixel_values`` preprocessing of a vision-language model, shared by the
tokenizer service (which preprocesses images once, next to the chat template) and the
encoder workers (which accept raw RGB pixels too).

`ImagePreprocessor.from_model_dir` uses the model's own image processor
(`transformers.AutoImageProcessor`, which falls back to its PIL/NumPy backend when
torchvision is missing). When that processor cannot be built at all -- torchvision-only
processors, or a transformers without the PIL backend -- it falls back to a small
PIL + NumPy implementation of the CLIP-style pipeline driven by the values of
``preprocessor_config.json`` (``do_convert_rgb``, ``do_resize`` with ``size``
``{shortest_edge}`` or ``{height, width}`` and ``resample``, ``do_center_crop`` with
``crop_size``, ``do_rescale``/``rescale_factor``, ``do_normalize`` with
``image_mean``/``image_std``), written to match transformers' PIL backend step for step.

Output: one float32 array of shape ``(3, H, W)`` per image (channels first). No grpc here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

PREPROCESSOR_CONFIG = "preprocessor_config.json"
_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR}
_RESAMPLE |= {3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


class _Pipeline(Protocol):
    def __call__(self, image: Image.Image) -> np.ndarray: ...


@dataclass(frozen=True)
class PreprocessSpec:
    """The CLIP-style pipeline values of a ``preprocessor_config.json``."""

    size: dict[str, int]
    resample: int = 3
    do_resize: bool = True
    do_center_crop: bool = True
    crop_size: dict[str, int] | None = None
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PreprocessSpec:
        """Reads the fields this pipeline understands; ValueError names a bad one."""
        size = raw.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if not isinstance(size, dict) or not (
            {"shortest_edge"} <= size.keys() or {"height", "width"} <= size.keys()
        ):
            raise ValueError(f"{PREPROCESSOR_CONFIG}: unsupported size {size!r}")
        crop = raw.get("crop_size")
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            size={k: int(v) for k, v in size.items()},
            resample=int(raw.get("resample", 3)),
            do_resize=bool(raw.get("do_resize", True)),
            do_center_crop=bool(raw.get("do_center_crop", crop is not None)),
            crop_size={k: int(v) for k, v in crop.items()} if isinstance(crop, dict) else None,
            do_rescale=bool(raw.get("do_rescale", True)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=_triple(raw.get("image_mean", 0.5), "image_mean"),
            image_std=_triple(raw.get("image_std", 0.5), "image_std"),
        )


def _triple(value: Any, name: str) -> tuple[float, ...]:
    values = [float(value)] * 3 if isinstance(value, int | float) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"{PREPROCESSOR_CONFIG}: {name} must have 3 values")
    return tuple(values)


def resize_output_size(height: int, width: int, size: dict[str, int]) -> tuple[int, int]:
    """(height, width) after resizing: the shortest edge to ``size["shortest_edge"]``
    (the long edge truncated, as transformers does), or exactly ``height`` x ``width``."""
    if "shortest_edge" not in size:
        return size["height"], size["width"]
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """Center crop of a channels-first array, zero-padded when the image is smaller."""
    _, h, w = array.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return array[:, top : top + height, left : left + width]
    out = np.zeros((array.shape[0], max(h, height), max(w, width)), dtype=array.dtype)
    pad_top, pad_left = max(-top, 0), max(-left, 0)
    out[:, pad_top : pad_top + h, pad_left : pad_left + w] = array
    return center_crop(out, height, width)


class SimplePipeline:
    """PIL + NumPy implementation of a :class:`PreprocessSpec` (the no-torchvision fallback)."""

    def __init__(self, spec: PreprocessSpec) -> None:
        self.spec = spec

    def __call__(self, image: Image.Image) -> np.ndarray:
        spec = self.spec
        image = image.convert("RGB")
        if spec.do_resize:
            height, width = resize_output_size(image.height, image.width, spec.size)
            image = image.resize(
                (width, height), resample=_RESAMPLE.get(spec.resample, Image.Resampling.BICUBIC)
            )
        array = np.asarray(image).transpose(2, 0, 1)
        if spec.do_center_crop and spec.crop_size is not None:
            array = center_crop(array, spec.crop_size["height"], spec.crop_size["width"])
        result = (
            array.astype(np.float64) * spec.rescale_factor if spec.do_rescale else array.astype(np.float64)
        )
        result = result.astype(np.float32)
        if spec.do_normalize:
            mean = np.asarray(spec.image_mean, dtype=np.float32)[:, None, None]
            std = np.asarray(spec.image_std, dtype=np.float32)[:, None, None]
            result = (result - mean) / std
        return np.ascontiguousarray(result, dtype=np.float32)


class _HfPipeline:
    """The model's own transformers image processor, one image at a time."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, image: Image.Image) -> np.ndarray:
        out = self.processor(images=image, return_tensors="np")["pixel_values"]
        array = np.asarray(out, dtype=np.float32)
        return np.ascontiguousarray(array[0] if array.ndim == 4 else array)


class ImagePreprocessor:
    """RGB pixels → float32 ``(3, H, W)`` pixel values for a model's vision tower."""

    def __init__(self, pipeline: _Pipeline, backend: str) -> None:
        self._pipeline = pipeline
        self.backend = backend

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, use_transformers: bool = True) -> ImagePreprocessor | None:
        """The model's preprocessor, or None when the directory has no ``preprocessor_config.json``."""
        path = Path(model_dir) / PREPROCESSOR_CONFIG
        if not path.is_file():
            return None
        if use_transformers:
            processor = _load_hf_processor(Path(model_dir))
            if processor is not None:
                return cls(_HfPipeline(processor), f"transformers:{type(processor).__name__}")
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object")
        return cls(SimplePipeline(PreprocessSpec.from_dict(raw)), "builtin")

    def __call__(self, rgb: bytes, width: int, height: int) -> np.ndarray:
        """Preprocesses one uint8 RGB image given as row-major (height, width, 3) bytes."""
        if width <= 0 or height <= 0 or len(rgb) != width * height * 3:
            raise ValueError(f"expected {width}x{height}x3 RGB bytes, got {len(rgb)} bytes")
        image = Image.frombytes("RGB", (width, height), rgb)
        return self._pipeline(image)


def _load_hf_processor(model_dir: Path) -> Any | None:
    try:
        import transformers
        from transformers import AutoImageProcessor

        previous = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # the "falling back to the PIL backend" notice
        try:
            return AutoImageProcessor.from_pretrained(str(model_dir))
        finally:
            transformers.logging.set_verbosity(previous)
    except Exception as exc:  # ImportError (torchvision), ValueError (unknown processor), ...
        log.warning("image processor of %s unusable (%s); using the built-in pipeline", model_dir, exc)
        return None
