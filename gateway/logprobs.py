"""Upstream `TokenLogprob`s → OpenAI logprobs objects (chat and legacy completions).

Token strings come from `Upstream.token_strings` (single-id Detokenize, cached).
`-inf` is not valid JSON, so logprobs are clamped to -9999.0 like vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.protocol import ChatLogprob, CompletionLogprobs, TopLogprob
from gateway.upstream import Upstream
from meshserve.v1 import common_pb2

MIN_LOGPROB = -9999.0


def _clamp(value: float) -> float:
    if math.isnan(value) or value < MIN_LOGPROB:
        return MIN_LOGPROB
    return float(value)


def token_ids_of(logprobs: Sequence[common_pb2.TokenLogprob], top_k: int) -> set[int]:
    """Every token id whose text the logprobs objects need."""
    ids: set[int] = set()
    for entry in logprobs:
        ids.add(entry.token_id)
        ids.update(top.token_id for top in entry.top[:top_k])
    return ids


async def resolve_strings(
    upstream: Upstream, model: str, logprobs: Sequence[common_pb2.TokenLogprob], top_k: int
) -> dict[int, str]:
    """Token strings for `logprobs` (empty when there is nothing to render)."""
    if not logprobs:
        return {}
    return await upstream.token_strings(model, token_ids_of(logprobs, top_k))


def chat_logprobs(
    logprobs: Sequence[common_pb2.TokenLogprob], strings: dict[int, str], top_k: int
) -> list[ChatLogprob]:
    """Chat `logprobs.content` entries."""
    out = []
    for entry in logprobs:
        token = strings.get(entry.token_id, "")
        tops = [
            TopLogprob(
                token=strings.get(t.token_id, ""),
                logprob=_clamp(t.logprob),
                bytes=list(strings.get(t.token_id, "").encode()),
            )
            for t in entry.top[:top_k]
        ]
        out.append(
            ChatLogprob(
                token=token, logprob=_clamp(entry.logprob), bytes=list(token.encode()), top_logprobs=tops
            )
        )
    return out


def completion_logprobs(
    logprobs: Sequence[common_pb2.TokenLogprob],
    strings: dict[int, str],
    top_k: int,
    text_offset: int,
) -> CompletionLogprobs:
    """Legacy completion logprobs; `text_offset` is where the first token starts.

    Built with every field passed explicitly, so `exclude_unset` dumps keep them."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for entry in logprobs:
        token = strings.get(entry.token_id, "")
        tokens.append(token)
        token_logprobs.append(_clamp(entry.logprob))
        tops = {strings.get(t.token_id, ""): _clamp(t.logprob) for t in entry.top[:top_k]}
        tops.setdefault(token, _clamp(entry.logprob))
        top_logprobs.append(tops)
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
    )
