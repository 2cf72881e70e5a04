"""TokenizerConfig: flags/env parsing, defaults and validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.config import load_config
from tokenizer_svc.config import TokenizerConfig


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags only: no MESHSERVE_* variables from the calling shell."""
    for name in list(os.environ):
        if name.startswith("MESHSERVE_"):
            monkeypatch.delenv(name)


def test_defaults_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    monkeypatch.setenv("MESHSERVE_ALLOWED_MEDIA_DOMAINS", "Images.Example.com, cdn.example.org.")
    config = load_config(TokenizerConfig, ["--model-dir", str(model), "--max-model-len", "512"])
    assert config.port == 50051 and config.served_model_name == "my-model"
    assert config.max_model_len == 512 and not config.allow_request_chat_template
    assert config.allowed_media_domains == ("images.example.com", "cdn.example.org")
    assert config.max_image_bytes == 10 * 1024 * 1024 and config.media_fetch_timeout_s == 5.0
    named = TokenizerConfig(model_dir=str(model), served_model_name="alias", allow_request_chat_template=True)
    assert named.served_model_name == "alias" and named.allow_request_chat_template


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "model_dir is required"),
        ({"model_dir": "/nonexistent/model"}, "not a directory"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"max_image_bytes": 0}, "max_image_bytes"),
        ({"media_fetch_timeout_s": 0.0}, "media_fetch_timeout_s"),
        ({"port": 70000}, "port"),
    ],
)
def test_validation(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"model_dir": str(tmp_path)} if "model_dir" not in kwargs and kwargs else {}
    with pytest.raises(ValueError, match=match):
        TokenizerConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_missing_model_dir_is_a_cli_error() -> None:
    with pytest.raises(SystemExit):
        load_config(TokenizerConfig, [])
