"""Configuration of the tokenizer service (flags `--model-dir` etc., env `MESHSERVE_*`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.config import DEFAULT_PORTS, ServerConfig, opt


@dataclass(frozen=True)
class TokenizerConfig(ServerConfig):
    """Tokenizer service: chat templates, tokenize/detokenize, stop strings, media parsing."""

    port: int = opt(DEFAULT_PORTS["tokenizer"], "the gRPC port")
    model_dir: str = opt("", "Hugging Face model directory holding the tokenizer (and config.json); required")
    served_model_name: str = opt("", "the name clients use in `model` (default: the directory's name)")
    max_model_len: int = opt(
        0, "context length reported to callers (0: the model config's max_position_embeddings)"
    )
    allow_request_chat_template: bool = opt(
        False,
        "accept a Jinja `chat_template` from requests (still sandboxed); off: callers cannot run templates",
    )
    allowed_media_domains: tuple[str, ...] = opt(
        (), "hosts http(s) image URLs may point to (exact host names); empty: none (no SSRF)"
    )
    max_image_bytes: int = opt(10 * 1024 * 1024, "the largest image accepted, in bytes")
    max_image_pixels: int = opt(
        4096 * 4096, "decoded pixel limit per image (width * height), against decompression bombs"
    )
    media_fetch_timeout_s: float = opt(5.0, "deadline of fetching one image URL")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_dir:
            raise ValueError("model_dir is required (--model-dir or MESHSERVE_MODEL_DIR)")
        if not os.path.isdir(self.model_dir):
            raise ValueError(f"model_dir {self.model_dir!r} is not a directory")
        if not self.served_model_name:
            name = os.path.basename(os.path.normpath(os.path.abspath(self.model_dir)))
            object.__setattr__(self, "served_model_name", name)
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.max_image_bytes <= 0:
            raise ValueError(f"max_image_bytes must be > 0, got {self.max_image_bytes}")
        if self.max_image_pixels <= 0:
            raise ValueError(f"max_image_pixels must be > 0, got {self.max_image_pixels}")
        if self.media_fetch_timeout_s <= 0:
            raise ValueError(f"media_fetch_timeout_s must be > 0, got {self.media_fetch_timeout_s}")
        domains = tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains if d.strip())
        object.__setattr__(self, "allowed_media_domains", domains)
