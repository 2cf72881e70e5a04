"""Structured outputs: grammar-constrained sampling with llguidance (no grpc here).

A constrained request carries a :class:`StructuredSpec` (kind + text: a JSON schema, a
regex, a list of choices or a Lark grammar). The engine never compiles on its own thread:
:class:`GrammarBackend` builds each request's matcher on a small thread pool (the
tokenizer-dependent compile of a grammar happens once; later requests with the same
grammar get a ``deep_copy`` of the cached, untouched matcher), the request waits outside
the scheduler until its matcher is ready, and other requests keep running meanwhile. A
preparation that fails there (a grammar that does not build with the tokenizer, resumed
tokens it refuses, bad words that cannot be tokenized) is that request's INVALID_ARGUMENT
naming the field: the engine hands it to the async engine (``LLMEngine.failed``), which
fails the request with it (a RequestError on the GenerateStream); it never held a block.

Per step the sampler asks each constrained row's matcher for the bitmask of tokens the
grammar allows (:func:`apply_grammar_masks`); every accepted token advances the matcher
(``consume_token``) exactly once -- a preempted request recomputes its KV but samples
nothing again, and a resumed (migrated) request replays its earlier output into a fresh
matcher before its first sample. ``is_stopped()`` after a token ends the request ("stop").

What each kind means and its grammar: services/grammar.py (shared with the gateway).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from services.errors import InvalidArgument
from services.grammar import StructuredSpec

log = logging.getLogger(__name__)

_CACHE_SIZE = 256


def _invalid(field: str, exc: ValueError) -> InvalidArgument:
    """The request's INVALID_ARGUMENT naming `field` (the message starts with it)."""
    message = str(exc) if str(exc).startswith(field) else f"{field}: {exc}"
    return InvalidArgument(message, param=field)


@dataclass
class Prepared:
    """What a request needs before it can be scheduled: its matcher (already advanced
    over ``resumed`` output) and its bad words as token sequences."""

    matcher: Any | None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()


class GrammarBackend:
    """Builds matchers off the engine thread, one compile per distinct grammar."""

    def __init__(self, model_dir: str, vocab_size: int, max_workers: int = 1) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="meshserve-grammar")
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.num_compiles = 0

    def prepare(
        self, spec: StructuredSpec | None, bad_words: Sequence[str], resumed: Sequence[int]
    ) -> Future[Prepared]:
        """Matcher (advanced over ``resumed``) and bad-word token ids, on the pool."""
        return self._pool.submit(self._prepare, spec, tuple(bad_words), tuple(resumed))

    def _prepare(
        self, spec: StructuredSpec | None, bad_words: tuple[str, ...], resumed: tuple[int, ...]
    ) -> Prepared:
        matcher = None
        if spec is not None:
            try:
                matcher = self._matcher(spec.validate())
                # Migration: the tokens generated on the lost worker went through a matcher
                # there; a fresh one must see them too, once, before the next sample.
                for position, token in enumerate(resumed):
                    if not matcher.consume_token(token):
                        raise ValueError(f"resumed output token {token} at {position} violates the grammar")
            except ValueError as exc:
                raise _invalid("structured_outputs", exc) from None
        try:
            return Prepared(matcher, self._bad_words_ids(bad_words))
        except ValueError as exc:
            raise _invalid("bad_words", exc) from None

    def _matcher(self, grammar: str) -> Any:
        import llguidance

        with self._lock:
            proto = self._cache.get(grammar)
            if proto is not None:
                self._cache.move_to_end(grammar)
                return proto.deep_copy()
        proto = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        if proto.is_error():
            raise ValueError(f"structured_outputs grammar failed to compile: {proto.get_error()[:500]}")
        with self._lock:
            self.num_compiles += 1
            self._cache[grammar] = proto
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return proto.deep_copy()

    def tokenizer(self) -> Any:
        """The model's HF tokenizer (from the worker's model directory), loaded once."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                try:
                    self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                except (OSError, ValueError) as exc:
                    raise ValueError(f"the model directory has no usable tokenizer: {exc}") from None
            return self._tokenizer

    def _llg_tokenizer(self) -> Any:
        import llguidance.hf

        tokenizer = self.tokenizer()
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word as tokens, alone and after a space (vLLM's rule), ids in vocab."""
        if not words:
            return ()
        tokenizer = self.tokenizer()
        sequences: set[tuple[int, ...]] = set()
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if ids and all(0 <= t < self.vocab_size for t in ids):
                    sequences.add(ids)
        return tuple(sorted(sequences))

    def close(self) -> None:
        """Stops the pool (pending preparations are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> None:
    """Masks (-inf, in place) the tokens each constrained row's grammar forbids now."""
    import llguidance.torch as llt

    bitmask = llt.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, matcher in enumerate(matchers):
        llt.fill_next_token_bitmask(matcher, bitmask, j)
    sub = logits[list(rows)]
    llt.apply_token_bitmask_inplace(sub, bitmask)
    logits[list(rows)] = sub
