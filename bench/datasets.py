"""Seeded workload generators for `bench.serve`.

Every dataset produces a list of `Session`s.  A session is one or more user turns sent in order
(the multi-turn dataset has several; all others have exactly one) plus an optional shared system
prompt.  Text is built from a fixed vocabulary of short, common English words, each of which is
about one token for BPE tokenizers, so ``n`` words ≈ ``n`` prompt tokens.  The same seed always
yields the same sessions.
"""

from __future__ import annotations

import base64
import random
import struct
import zlib
from dataclasses import dataclass
from typing import Any

DATASETS = ("random", "shared-prefix", "multi-turn", "images")

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part over new sound take only little work know place year live me back give "
    "most very after thing our just name good sentence man think say great where help through much before "
    "line right too mean old any same tell boy follow came want show also around form three small set put "
    "end does another well large must big even such because turn here why ask went men read need land "
    "different home us move try kind hand picture again change off play spell air away animal house point "
    "page letter mother answer found study still learn should world high every near add food between own "
    "below country plant last school father keep tree never start city earth eye light thought head under "
    "story saw left few while along might close something seem next hard open example begin life always"
).split()

ContentPart = dict[str, Any]
Content = str | list[ContentPart]


@dataclass(frozen=True)
class Turn:
    """One user message: text or OpenAI content parts, and its approximate token count."""

    content: Content
    input_len: int


@dataclass(frozen=True)
class Session:
    """A conversation: user turns sent one after another, each answer appended before the next."""

    turns: tuple[Turn, ...]
    output_len: int
    system: str | None = None


@dataclass(frozen=True)
class DatasetConfig:
    """Parameters shared by all generators (unused ones are ignored)."""

    name: str = "random"
    num_prompts: int = 100
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0
    num_prefixes: int = 4
    prefix_len: int | None = None
    num_turns: int = 3
    image_pool: int = 4
    image_size: int = 64


def random_text(rng: random.Random, num_words: int) -> str:
    """`num_words` random vocabulary words joined by spaces (≈ `num_words` tokens)."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(0, num_words)))


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean·(1-r), mean·(1+r)] (exactly `mean` when r == 0), at least 1."""
    if range_ratio <= 0:
        return max(1, mean)
    low = int(mean * (1.0 - range_ratio))
    high = int(mean * (1.0 + range_ratio))
    return max(1, rng.randint(low, high))


def random_sessions(cfg: DatasetConfig) -> list[Session]:
    """Independent single-turn prompts of ≈ input_len random words each."""
    rng = random.Random(cfg.seed)
    sessions = []
    for _ in range(cfg.num_prompts):
        n_in = sample_len(rng, cfg.input_len, cfg.range_ratio)
        n_out = sample_len(rng, cfg.output_len, cfg.range_ratio)
        sessions.append(Session(turns=(Turn(random_text(rng, n_in), n_in),), output_len=n_out))
    return sessions


def shared_prefix_sessions(cfg: DatasetConfig) -> list[Session]:
    """K shared system prompts (prefix_len words each) reused round-robin, plus random suffixes.

    The default prefix is half of input_len; the suffix makes up the rest.  Prefix assignment is
    shuffled so requests sharing a prefix are interleaved, as in real traffic.
    """
    rng = random.Random(cfg.seed)
    prefix_len = cfg.prefix_len if cfg.prefix_len is not None else cfg.input_len // 2
    suffix_len = max(1, cfg.input_len - prefix_len)
    prefixes = [random_text(rng, prefix_len) for _ in range(max(1, cfg.num_prefixes))]
    order = [i % len(prefixes) for i in range(cfg.num_prompts)]
    rng.shuffle(order)
    sessions = []
    for idx in order:
        n_in = sample_len(rng, suffix_len, cfg.range_ratio)
        n_out = sample_len(rng, cfg.output_len, cfg.range_ratio)
        turn = Turn(random_text(rng, n_in), prefix_len + n_in)
        sessions.append(Session(turns=(turn,), output_len=n_out, system=prefixes[idx]))
    return sessions


def multi_turn_sessions(cfg: DatasetConfig) -> list[Session]:
    """`num_prompts` conversations of `num_turns` user turns of ≈ input_len words each.

    The runner sends turn i+1 only after turn i's answer arrived, with that answer appended to
    the history, so the prompt grows by (input_len + output_len) per turn.
    """
    rng = random.Random(cfg.seed)
    sessions = []
    for _ in range(cfg.num_prompts):
        turns = []
        for _ in range(max(1, cfg.num_turns)):
            n_in = sample_len(rng, cfg.input_len, cfg.range_ratio)
            turns.append(Turn(random_text(rng, n_in), n_in))
        sessions.append(
            Session(turns=tuple(turns), output_len=sample_len(rng, cfg.output_len, cfg.range_ratio))
        )
    return sessions


def image_sessions(cfg: DatasetConfig) -> list[Session]:
    """Chat prompts with random text plus one PNG image drawn from a fixed pool (so images repeat)."""
    rng = random.Random(cfg.seed)
    pool = [
        png_data_url(make_png(cfg.image_size, cfg.image_size, cfg.seed * 7919 + i))
        for i in range(max(1, cfg.image_pool))
    ]
    sessions = []
    for _ in range(cfg.num_prompts):
        n_in = sample_len(rng, cfg.input_len, cfg.range_ratio)
        parts: list[ContentPart] = [
            {"type": "text", "text": random_text(rng, n_in)},
            {"type": "image_url", "image_url": {"url": rng.choice(pool)}},
        ]
        n_out = sample_len(rng, cfg.output_len, cfg.range_ratio)
        sessions.append(Session(turns=(Turn(parts, n_in),), output_len=n_out))
    return sessions


def build_dataset(cfg: DatasetConfig) -> list[Session]:
    """Dispatch to the generator named by `cfg.name`."""
    generators = {
        "random": random_sessions,
        "shared-prefix": shared_prefix_sessions,
        "multi-turn": multi_turn_sessions,
        "images": image_sessions,
    }
    if cfg.name not in generators:
        raise ValueError(f"unknown dataset {cfg.name!r}; choose from {', '.join(DATASETS)}")
    return generators[cfg.name](cfg)


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, tag, payload, CRC."""
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def make_png(width: int, height: int, seed: int) -> bytes:
    """A deterministic RGB PNG (gradient between two seeded colours with a checker overlay)."""
    rng = random.Random(seed)
    c1 = [rng.randrange(256) for _ in range(3)]
    c2 = [rng.randrange(256) for _ in range(3)]
    cell = rng.choice((4, 8, 16))
    rows = bytearray()
    for y in range(height):
        rows.append(0)  # filter type: none
        for x in range(width):
            t = x / max(1, width - 1)
            dark = ((x // cell) + (y // cell)) % 2 == 0
            for a, b in zip(c1, c2, strict=True):
                v = int(a + (b - a) * t)
                rows.append(v // 2 if dark else v)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(bytes(rows), 9))
        + _png_chunk(b"IEND", b"")
    )


def png_data_url(png: bytes) -> str:
    """`data:image/png;base64,...` URL for an OpenAI `image_url` content part."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
