"""IncrementalDetokenizer: UTF-8 safe streaming and stop strings, against a full decode."""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.detokenizer import IncrementalDetokenizer, make_decoder
from services.errors import InvalidArgument

MULTIBYTE_TEXT = "Café naïve — 你好，世界! 🎉🚀 emoji 👩‍💻 and ∑ math"


@dataclass(frozen=True)
class Tok:
    """A Hugging Face tokenizer with the encode/decode helpers these tests use."""

    tokenizer: Any

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


class SlowPathTokenizer:
    """Only `decode`: forces IncrementalDetokenizer onto its generic (non-Rust) path."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return list(self._tokenizer.encode(text, **kwargs))

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return str(self._tokenizer.decode(ids, **kwargs))


@pytest.fixture(scope="session")
def renderer(tiny_model_dir: Path) -> Tok:
    return Tok(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="session")
def slow_renderer(renderer: Tok) -> Tok:
    return Tok(SlowPathTokenizer(renderer.tokenizer))


def stream(
    renderer: Tok,
    ids: Sequence[int],
    chunks: Sequence[int] | None = None,
    stop: Sequence[str] = (),
    include: bool = False,
    skip_special: bool = True,
    prompt: Sequence[int] = (),
) -> tuple[list[str], IncrementalDetokenizer]:
    """Pushes `ids` in chunks of the given sizes (default one by one); returns every piece."""
    detok = IncrementalDetokenizer(renderer.tokenizer, prompt, skip_special, stop, include)
    sizes = list(chunks) if chunks is not None else [1] * len(ids)
    pieces, start = [], 0
    for size in sizes:
        step = detok.push(ids[start : start + size])
        start += size
        pieces.append(step.text)
        if step.stopped:
            break
    pieces.append(detok.finish())
    return pieces, detok


def reference(full: str, stops: Sequence[str], include: bool) -> str:
    """`full` cut at the stop string that completes first (ties: the longest)."""
    best = None
    for stop in stops:
        index = full.find(stop)
        if index >= 0:
            candidate = (index + len(stop), index)
            best = candidate if best is None else min(best, candidate)
    if best is None:
        return full
    return full[: best[0]] if include else full[: best[1]]


def test_multibyte_characters_span_several_tokens(renderer: Tok) -> None:
    ids = renderer.encode(MULTIBYTE_TEXT, False)
    singles = [renderer.decode([i], skip_special_tokens=True) for i in ids]
    assert any("\ufffd" in s for s in singles), "test text must split characters across tokens"
    pieces, _ = stream(renderer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == MULTIBYTE_TEXT == renderer.decode(ids, skip_special_tokens=True)


def test_prompt_context_does_not_change_the_text(renderer: Tok) -> None:
    prompt = renderer.encode("<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n", False)
    ids = renderer.encode(" 🎉 well done", False)
    pieces, _ = stream(renderer, ids, prompt=prompt)
    assert "".join(pieces) == " 🎉 well done"


def test_incomplete_character_is_flushed_on_finish(renderer: Tok) -> None:
    ids = renderer.encode("ok 🎉", False)[:-1]  # cut inside the emoji's bytes
    pieces, _ = stream(renderer, ids)
    assert "\ufffd" not in "".join(pieces[:-1])
    assert "".join(pieces) == renderer.decode(ids, skip_special_tokens=True)
    assert pieces[-1].endswith("\ufffd")


def test_stop_string_spanning_tokens_is_never_emitted(renderer: Tok) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = renderer.encode(text, False)
    stop = "jumps over"
    assert not any(stop in renderer.decode([i], skip_special_tokens=True) for i in ids)
    pieces, detok = stream(renderer, ids, stop=[stop])
    assert "".join(pieces) == "The quick brown fox "
    assert detok.stopped and detok.matched_stop == stop
    consumed = renderer.decode(ids[: detok.num_tokens], skip_special_tokens=True)
    assert stop in consumed and stop not in renderer.decode(
        ids[: detok.num_tokens - 1], skip_special_tokens=True
    )


def test_include_stop_str_in_output(renderer: Tok) -> None:
    ids = renderer.encode("The quick brown fox jumps over the lazy dog", False)
    pieces, _ = stream(renderer, ids, stop=["jumps over"], include=True)
    assert "".join(pieces) == "The quick brown fox jumps over"


def test_possible_stop_prefix_is_held_back_then_released(renderer: Tok) -> None:
    detok = IncrementalDetokenizer(renderer.tokenizer, (), True, ["STOP"], False)
    first = detok.push(renderer.encode("abc ST", False))
    assert first.text == "abc " and not first.stopped
    second = detok.push(renderer.encode("ay", False))
    assert second.text == "STay"
    third = detok.push(renderer.encode(" ok STO", False))
    assert third.text == " ok "
    final = detok.push(renderer.encode("P and more", False))
    assert final.stopped and final.text == "" and final.matched_stop == "STOP"
    assert detok.push(renderer.encode("more", False)).text == ""
    assert detok.finish() == ""


def test_earliest_completed_stop_wins(renderer: Tok) -> None:
    ids = renderer.encode("xabcd", False)
    pieces, detok = stream(renderer, ids, chunks=[len(ids)], stop=["abcd", "c"])
    assert "".join(pieces) == "xab" and detok.matched_stop == "c"


def test_skip_special_tokens(renderer: Tok) -> None:
    ids = renderer.encode("Hello<|im_end|>", False)
    assert "".join(stream(renderer, ids, skip_special=True)[0]) == "Hello"
    assert "".join(stream(renderer, ids, skip_special=False)[0]) == "Hello<|im_end|>"


def test_empty_stop_string_is_refused(renderer: Tok) -> None:
    with pytest.raises(InvalidArgument, match=r"stop\[1\]"):
        IncrementalDetokenizer(renderer.tokenizer, (), True, ["ok", ""], False)


def _random_case(rng: random.Random, renderer: Tok) -> None:
    vocab = renderer.vocab_size
    if rng.random() < 0.5:
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
    else:
        words = rng.choices(
            ["héllo", " 世界", "🎉", " the", "ab", "c", " STOP", "\n", "ü"], k=rng.randint(1, 12)
        )
        ids = renderer.encode("".join(words), False)
    skip = rng.random() < 0.5
    full = renderer.decode(ids, skip_special_tokens=skip)
    stops: list[str] = []
    for _ in range(rng.randint(0, 3)):
        if full and rng.random() < 0.7:
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 4)])
        else:
            stops.append(rng.choice(["zz", "STOP", "🎉", "é"]))
    include = rng.random() < 0.5
    chunks, left = [], len(ids)
    while left:
        chunks.append(min(left, rng.randint(1, 4)))
        left -= chunks[-1]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
    pieces, _ = stream(renderer, ids, chunks, stops, include, skip, prompt)
    assert "".join(pieces) == reference(full, stops, include), (ids, stops, include, skip, prompt)


def test_random_sequences_match_full_decode(renderer: Tok) -> None:
    rng = random.Random(1234)
    for _ in range(1000):
        _random_case(rng, renderer)


def test_generic_decode_path_matches_full_decode(renderer: Tok, slow_renderer: Tok) -> None:
    """Tokenizers without the stock fast decode go through `tokenizer.decode`."""
    assert "backend_tokenizer" not in dir(slow_renderer.tokenizer)
    rng = random.Random(99)
    for _ in range(200):
        _random_case(rng, slow_renderer)


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decoder_equals_tokenizer_decode(renderer: Tok, skip: bool) -> None:
    """The Rust shortcut decodes exactly like transformers' decode (specials, partial bytes)."""
    fast = make_decoder(renderer.tokenizer, skip)
    assert isinstance(fast, functools.partial)  # the Rust shortcut is taken
    rng = random.Random(7)
    cases = [renderer.encode(MULTIBYTE_TEXT + "<|im_end|>", False)]
    cases += [[rng.randrange(renderer.vocab_size) for _ in range(rng.randint(1, 8))] for _ in range(300)]
    for ids in cases:
        expected = renderer.tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
        assert fast(ids) == expected, ids


def test_stop_prefix_after_a_false_start_is_held_back(renderer: Tok) -> None:
    """'SST' with stop 'STOP': the first S cannot start the stop, the second can."""
    detok = IncrementalDetokenizer(renderer.tokenizer, (), True, ["STOP"], False)
    assert detok.push(renderer.encode("SST", False)).text == "S"
    final = detok.push(renderer.encode("OP and more", False))
    assert final.stopped and final.text == "" and final.matched_stop == "STOP"


@pytest.mark.parametrize("method", ["decode", "_decode"])
def test_tokenizer_subclass_overriding_decode_is_honoured(renderer: Tok, method: str) -> None:
    """A tokenizer class that changes decode (as whisper's does) keeps its own decode."""
    base = type(renderer.tokenizer)

    def shouting(self: Any, *args: Any, **kwargs: Any) -> str:
        return str(getattr(super(subclass, self), method)(*args, **kwargs)).upper()

    subclass = type("ShoutingTokenizer", (base,), {method: shouting})
    tokenizer = copy.copy(renderer.tokenizer)
    tokenizer.__class__ = subclass
    ids = renderer.encode("quiet words", False)
    assert not isinstance(make_decoder(tokenizer, True), functools.partial)
    pieces, _ = stream(Tok(tokenizer), ids)
    assert "".join(pieces) == "QUIET WORDS"
