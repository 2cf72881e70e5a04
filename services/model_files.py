"""Facts read from a Hugging Face model directory that several services need the same
way (the tokenizer service and a gateway's in-process tokenizer must agree on them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's content; {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def eos_token_ids(model_dir: Path, tokenizer_eos_id: int | None) -> list[int]:
    """EOS ids: generation_config.json's `eos_token_id` (int or list), then the
    tokenizer's own, deduplicated, in that order."""
    configured = read_json(model_dir / "generation_config.json").get("eos_token_id")
    candidates = [*(configured if isinstance(configured, list) else [configured]), tokenizer_eos_id]
    found: list[int] = []
    for candidate in candidates:
        if isinstance(candidate, int) and candidate >= 0 and candidate not in found:
            found.append(candidate)
    return found
