"""Image inputs of chat requests: `image_url` parts → decoded, normalised, content-hashed
images, and expansion of their placeholder token in the prompt.

Domain code: no grpc. Bad input raises `InvalidArgument` naming the field
(`messages[i].content[j].image_url`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import logging
import time
import urllib.parse
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from PIL import Image, ImageOps, UnidentifiedImageError

from services.errors import InvalidArgument
from services.image_preprocess import ImagePreprocessor
from services.model_files import read_json

log = logging.getLogger(__name__)

_FETCH_CHUNK = 64 * 1024
# Raster formats PIL may decode from requests (never e.g. EPS, which runs Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
Image.init()  # registers every plugin, so `formats=` can name them all


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be."""

    allowed_domains: tuple[str, ...] = ()
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    fetch_timeout_s: float = 5.0


@dataclass(frozen=True)
class ImageData:
    """A decoded RGB image: raw uint8 pixels in row-major (H, W, 3) order."""

    identifier: str
    width: int
    height: int
    rgb: bytes

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)


@dataclass(frozen=True)
class MultiModalItem:
    """One multimodal item placed in a prompt (mirrors meshserve.v1.MultiModalItem)."""

    identifier: str
    modality: str
    offset: int
    length: int
    data: bytes
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ImageTokenSpec:
    """How a model marks an image in its prompt: `seq_length` copies of `token_id`."""

    token: str
    token_id: int
    seq_length: int


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_image(url: str, field: str, policy: MediaPolicy) -> ImageData:
    """Decodes the image a `data:` or allowed http(s) URL points to.

    Raises InvalidArgument naming `field` for a malformed URL, a refused host, a payload
    over the size limit or bytes that are not an image.
    """
    if url.startswith("data:"):
        raw = decode_data_url(url, field, policy.max_image_bytes)
    elif url.startswith(("http://", "https://")):
        raw = fetch_remote(url, field, policy)
    else:
        raise InvalidArgument(f"{field}: only data: and http(s) URLs are supported", param=field)
    return decode_image(raw, field, policy.max_image_pixels)


def decode_data_url(url: str, field: str, max_bytes: int) -> bytes:
    """The payload of a `data:image/...;base64,...` URL."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise InvalidArgument(f"{field}: malformed data URL (no ',')", param=field)
    media_type, *params = header[len("data:") :].split(";")
    if not media_type.lower().startswith("image/"):
        raise InvalidArgument(
            f"{field}: data URL media type must be image/*, got {media_type!r}", param=field
        )
    if "base64" not in (p.strip().lower() for p in params):
        raise InvalidArgument(f"{field}: data URL must be base64-encoded", param=field)
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise InvalidArgument(f"{field}: image is larger than {max_bytes} bytes", param=field)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"{field}: invalid base64 data ({exc})", param=field) from exc
    if len(raw) > max_bytes:
        raise InvalidArgument(f"{field}: image is larger than {max_bytes} bytes", param=field)
    return raw


def host_allowed(url: str, allowed_domains: Sequence[str]) -> bool:
    """True when `url`'s host is exactly one of `allowed_domains` (case-insensitive)."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
    return bool(host) and host in {d.lower().rstrip(".") for d in allowed_domains}


def fetch_remote(url: str, field: str, policy: MediaPolicy) -> bytes:
    """Downloads an image from an allowed host (no redirects), within time and size limits."""
    if not host_allowed(url, policy.allowed_domains):
        raise InvalidArgument(
            f"{field}: fetching images from this host is not allowed (allowed_media_domains)",
            param=field,
        )
    deadline = time.monotonic() + policy.fetch_timeout_s
    try:
        with (
            httpx.Client(timeout=policy.fetch_timeout_s, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise InvalidArgument(
                    f"{field}: fetching the image returned HTTP {response.status_code}", param=field
                )
            return _read_limited(response, field, policy.max_image_bytes, deadline)
    except httpx.HTTPError as exc:
        raise InvalidArgument(
            f"{field}: could not fetch the image ({type(exc).__name__})", param=field
        ) from exc


def _read_limited(response: httpx.Response, field: str, max_bytes: int, deadline: float) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise InvalidArgument(f"{field}: image is larger than {max_bytes} bytes", param=field)
    body = bytearray()
    for chunk in response.iter_bytes(_FETCH_CHUNK):
        body.extend(chunk)
        if len(body) > max_bytes:
            raise InvalidArgument(f"{field}: image is larger than {max_bytes} bytes", param=field)
        if time.monotonic() > deadline:
            raise InvalidArgument(f"{field}: fetching the image timed out", param=field)
    return bytes(body)


def decode_image(raw: bytes, field: str, max_pixels: int) -> ImageData:
    """Decodes image bytes with PIL into normalised RGB (EXIF-rotated, alpha on white)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidArgument(
                    f"{field}: image has {width}x{height} pixels, more than the limit of {max_pixels}",
                    param=field,
                )
            image.load()
            rgb = _to_rgb(ImageOps.exif_transpose(image))
    except InvalidArgument:
        raise
    except (
        UnidentifiedImageError,
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as exc:
        raise InvalidArgument(f"{field}: not a decodable image ({type(exc).__name__})", param=field) from exc
    pixels = rgb.tobytes()
    return ImageData(content_hash(rgb.width, rgb.height, pixels), rgb.width, rgb.height, pixels)


def _to_rgb(image: Image.Image) -> Image.Image:
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def content_hash(width: int, height: int, rgb: bytes) -> str:
    """Hex sha256 identifying an image by its normalised pixels and size."""
    digest = hashlib.sha256(f"rgb8:{width}x{height}:".encode())
    digest.update(rgb)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Placeholders
# ---------------------------------------------------------------------------------------------


def _image_token(tokenizer: Any, config: dict[str, Any]) -> str | None:
    token = getattr(tokenizer, "image_token", None)
    if isinstance(token, str) and token:
        return token
    for key in ("image_token_index", "image_token_id"):
        token_id = config.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            converted = tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(converted, str):
                return converted
    if "<image>" in getattr(tokenizer, "all_special_tokens", ()):
        return "<image>"
    return None


def _image_seq_length(model_dir: Path, config: dict[str, Any]) -> int:
    sources = [read_json(model_dir / name) for name in ("processor_config.json", "preprocessor_config.json")]
    sources.append(config)
    for source in sources:
        for key in ("image_seq_length", "mm_tokens_per_image", "num_image_tokens"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    vision = config.get("vision_config")
    if isinstance(vision, dict):
        size, patch = vision.get("image_size"), vision.get("patch_size")
        if isinstance(size, int) and isinstance(patch, int) and patch > 0:
            return (size // patch) ** 2
    return 1


def find_image_token_spec(tokenizer: Any, model_dir: str | Path) -> ImageTokenSpec | None:
    """The model's image placeholder, or None when the model takes no image inputs.

    Looks for `tokenizer.image_token`, `image_token_index`/`image_token_id` in config.json
    or an `<image>` special token; the number of tokens per image comes from
    `image_seq_length` (processor/preprocessor/model config), `mm_tokens_per_image`, the
    vision config's (image_size / patch_size)², else 1.
    """
    directory = Path(model_dir)
    config = read_json(directory / "config.json")
    token = _image_token(tokenizer, config)
    if token is None:
        return None
    token_id = tokenizer.convert_tokens_to_ids(token)
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(token_id, int) or token_id < 0 or (token_id == unk and token != tokenizer.unk_token):
        return None
    return ImageTokenSpec(token, token_id, _image_seq_length(directory, config))


def expand_image_placeholders(
    token_ids: Sequence[int], images: Sequence[ImageData], spec: ImageTokenSpec
) -> tuple[list[int], list[MultiModalItem]]:
    """Replaces the i-th image token in `token_ids` by `spec.seq_length` copies and records
    where image i lies. The number of image tokens must equal the number of images."""
    positions = [i for i, t in enumerate(token_ids) if t == spec.token_id]
    if len(positions) != len(images):
        raise InvalidArgument(
            f"messages: the prompt has {len(positions)} image placeholders ({spec.token!r}) "
            f"but {len(images)} images were given",
            param="messages",
        )
    out: list[int] = []
    items: list[MultiModalItem] = []
    start = 0
    for position, image in zip(positions, images, strict=True):
        out.extend(token_ids[start:position])
        items.append(
            MultiModalItem(
                identifier=image.identifier,
                modality="image",
                offset=len(out),
                length=spec.seq_length,
                data=image.rgb,
                dtype="uint8",
                shape=image.shape,
            )
        )
        out.extend([spec.token_id] * spec.seq_length)
        start = position + 1
    out.extend(token_ids[start:])
    return out, items


def with_pixel_values(
    items: Sequence[MultiModalItem], images: Sequence[ImageData], preprocess: ImagePreprocessor | None
) -> list[MultiModalItem]:
    """Items whose payload is the model's pixel values (float32 ``(3, H, W)``, from its image
    processor) instead of raw RGB, so encoders get exactly what the vision tower takes.
    Without a preprocessor the raw uint8 ``(H, W, 3)`` pixels stay."""
    if preprocess is None:
        return list(items)
    out = []
    for item, image in zip(items, images, strict=True):
        pixels = preprocess(image.rgb, image.width, image.height)
        out.append(
            dataclasses.replace(item, data=pixels.tobytes(), dtype=str(pixels.dtype), shape=pixels.shape)
        )
    return out
