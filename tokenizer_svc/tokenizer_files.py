"""The tokenizer files of a model directory, read in chunks with their sha256, for
`Tokenizer.GetTokenizer` (a gateway loads the same tokenizer from them and detokenizes
in-process, without a model volume).

Domain code: no grpc. Reading is blocking file I/O; the servicer runs it in threads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# What `AutoTokenizer.from_pretrained` may read for a text tokenizer, plus the two small
# configs that hold the model type (the tokenizer class of some models) and EOS ids.
# Weights and processor files are deliberately absent.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
)
# gRPC messages stay far below the 4 MiB default limit of any client.
CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class FileChunk:
    """Part of one file; the file's last chunk has `last`, `sha256` (hex) and `size`."""

    name: str
    data: bytes
    sha256: str = ""
    size: int = 0
    last: bool = False


def tokenizer_files(model_dir: Path) -> list[Path]:
    """The tokenizer files present in `model_dir`, in TOKENIZER_FILE_NAMES order."""
    return [model_dir / name for name in TOKENIZER_FILE_NAMES if (model_dir / name).is_file()]


def read_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[FileChunk]:
    """`path` in chunks of at most `chunk_bytes` (an empty file is one empty chunk).

    The hash and size describe exactly the bytes yielded, so a file replaced while it is
    read is still self-consistent (the reader verifies what it received).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as file:
        data = file.read(chunk_bytes)
        while True:
            following = file.read(chunk_bytes) if data else b""
            digest.update(data)
            size += len(data)
            if not following:
                yield FileChunk(path.name, data, digest.hexdigest(), size, last=True)
                return
            yield FileChunk(path.name, data)
            data = following
