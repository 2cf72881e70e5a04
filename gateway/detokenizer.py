"""Incremental, UTF-8 safe detokenization of one generated sequence, with stop strings.

Decoding uses the prefix/read-offset technique of vLLM: each new token is decoded
together with a few preceding tokens (`ids[prefix_offset:]`) and only the text beyond
the decoding of `ids[prefix_offset:read_offset]` is new. When that text ends with
U+FFFD the last tokens hold an incomplete multi-byte character, so nothing is emitted
and the offsets stay until a later token completes it (or `finish` flushes it).

Stop strings: the text is searched for every stop string after each token; the stop that
completes first wins (as if checked character by character). Emitted text
never reaches past a stop; the longest tail of the text that is a proper prefix of some
stop string is held back until it is known not to start a stop. The concatenation of
everything returned equals `tokenizer.decode(all_output_ids)` cut at the first stop
(after the stop string when `include_stop_str_in_output`).

Cost: a push of one token is two decodes of a few ids plus string work (a few µs). For
Hugging Face fast tokenizers whose decode is the stock one, the decodes go straight to the
Rust `tokenizers.Tokenizer.decode`, which returns the same text as
`tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
without transformers' per-call Python overhead (about 3/4 of the decode time).

Domain code: no grpc.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.errors import InvalidArgument

# Prompt tokens decoded in front of the first generated token (as vLLM does), so that
# decoders that depend on context (leading spaces) produce the same text as a full decode.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
# Where transformers defines the stock `decode` / `_decode` of fast tokenizers: for these,
# decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False) is exactly
# backend_tokenizer.decode(ids, skip_special_tokens=s). Subclasses that override either
# method (whisper, wav2vec2, ...) keep the generic path.
_STOCK_DECODE_MODULES = {
    "decode": "transformers.tokenization_utils_base",
    "_decode": "transformers.tokenization_utils_tokenizers",
}


_stock_decode_by_type: dict[type, bool] = {}


def _has_stock_decode(tokenizer_type: type) -> bool:
    known = _stock_decode_by_type.get(tokenizer_type)
    if known is None:
        owners = {
            method: next((c.__module__ for c in tokenizer_type.__mro__ if method in vars(c)), None)
            for method in _STOCK_DECODE_MODULES
        }
        known = _stock_decode_by_type[tokenizer_type] = owners == _STOCK_DECODE_MODULES
    return known


def make_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`ids -> text` equal to `tokenizer.decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)`; calls the Rust backend directly when the
    tokenizer's decode is transformers' stock fast-tokenizer one, which reduces to it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _has_stock_decode(type(tokenizer)):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)

    def decode(ids: list[int]) -> str:
        return str(
            tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        )

    return decode


@dataclass(frozen=True)
class DetokenizeStep:
    """Text released by one `push`; `stopped` once a stop string matched."""

    text: str
    stopped: bool = False
    matched_stop: str = ""
    # Output tokens consumed so far, including the one that completed a stop string.
    num_tokens: int = 0


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas, UTF-8 safe, honouring stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids_tail: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        for i, stop_str in enumerate(stop):
            if not isinstance(stop_str, str) or not stop_str:
                raise InvalidArgument(f"stop[{i}] must be a non-empty string", param="stop")
        self._decode_ids = make_decoder(tokenizer, skip_special_tokens)
        self._stops = list(dict.fromkeys(stop))
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids_tail)[-PROMPT_CONTEXT_TOKENS:]
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_REPLACEMENT):
            # The context ends inside a character; decoding after it would misalign.
            self._ids, self._prefix_text = [], ""
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Decoded text not returned yet. A stop match always starts in it: everything
        # that could begin a stop string is held back here.
        self._pending = ""
        self.num_tokens = 0
        self.stopped = False
        self.matched_stop = ""
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""

    def _decode_next(self, token_id: int) -> str:
        """Appends one token; returns the newly completed text (maybe empty)."""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Slide the window: the tokens just read become the next prefix.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        """The stop string that completes first (earliest end; on a tie the longest), as if
        the text were checked character by character."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            index = self._pending.find(stop, max(0, search_from))
            if index >= 0:
                candidate = (index + len(stop), index, stop)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[1], best[2])

    def _held_back(self) -> int:
        """Length of the longest tail of the text (at most max_stop_len - 1 characters) that
        is a prefix of a stop string."""
        text = self._pending
        end = len(text)
        lowest = max(0, end - self._max_stop_len + 1)
        best = 0
        for stop in self._stops:
            # Only positions holding the stop's first character can start such a tail;
            # str.find skips the rest in C, where testing every tail length would be a Python
            # loop per token and stop. The first hit is the longest tail for this stop.
            start = text.find(stop[0], max(lowest, end - len(stop)))
            while start >= 0:
                if stop.startswith(text[start:]):
                    best = max(best, end - start)
                    break
                start = text.find(stop[0], start + 1)
        return best

    def _take(self, end: int) -> str:
        text, self._pending = self._pending[:end], self._pending[end:]
        return text

    def _append(self, delta: str) -> bool:
        """Adds decoded text; True when it completed a stop string."""
        if not delta:
            return False
        search_from = len(self._pending) - self._max_stop_len + 1
        self._pending += delta
        match = self._find_stop(search_from) if self._stops else None
        if match is None:
            return False
        index, stop = match
        self.stopped, self.matched_stop = True, stop
        end = index + len(stop) if self._include_stop else index
        self._pending = self._pending[:end]
        return True

    def _step(self, text: str) -> DetokenizeStep:
        return DetokenizeStep(text, self.stopped, self.matched_stop, self.num_tokens)

    def push(self, token_ids: Sequence[int]) -> DetokenizeStep:
        """Consumes generated token ids; returns the text that is now safe to emit.

        Stops consuming at the token that completes a stop string (`stopped=True`); later
        calls return empty steps.
        """
        if self.stopped or self.finished:
            return self._step("")
        for token_id in token_ids:
            self.num_tokens += 1
            if self._append(self._decode_next(int(token_id))):
                return self._step(self._take(len(self._pending)))
        return self._step(self._take(len(self._pending) - self._held_back()))

    def finish(self) -> str:
        """The sequence ended: flushes held-back text (incomplete characters decode to U+FFFD,
        as in a full decode). Later calls return ''."""
        if self.stopped or self.finished:
            self.finished = True
            return ""
        self.finished = True
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(self._prefix_text):
            self._append(full[len(self._prefix_text) :])
        return self._take(len(self._pending))
