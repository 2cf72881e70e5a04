"""Upstream `TokenLogprob`s → OpenAI logprobs objects (chat and legacy completions, echo's
prompt part included) and vLLM's `prompt_logprobs`.

Token strings come from `Upstream.token_strings` (single-id Detokenize, cached).
`-inf` is not valid JSON, so logprobs are clamped to -9999.0 like vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.protocol import ChatLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob
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


async def echo_part(
    upstream: Upstream,
    model: str,
    prompt_ids: Sequence[int],
    prompt_logprobs: Sequence[common_pb2.TokenLogprob],
    top_k: int,
) -> CompletionLogprobs:
    """The prompt's part of echo's legacy logprobs: the first token with None (it has no
    context), then each prompt token scored; text offsets from 0."""
    ids = {prompt_ids[0], *token_ids_of(prompt_logprobs, top_k)}
    strings = await upstream.token_strings(model, ids)
    first = strings.get(prompt_ids[0], "")
    rest = completion_logprobs(prompt_logprobs, strings, top_k, len(first))
    return CompletionLogprobs(
        tokens=[first, *rest.tokens],
        token_logprobs=[None, *rest.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs],
        text_offset=[0, *rest.text_offset],
    )


def end_offset(logprobs: CompletionLogprobs) -> int:
    """Text offset just after the last token of `logprobs`."""
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1]) if logprobs.tokens else 0


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """Two runs of legacy logprobs as one (echo: the prompt's, then the generated ones)."""
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


async def vllm_prompt_logprobs(
    upstream: Upstream, model: str, prompt_logprobs: Sequence[common_pb2.TokenLogprob], top_k: int
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict of
    token id -> (logprob, rank, decoded token) holding the prompt token and the top-K."""
    strings = await upstream.token_strings(model, token_ids_of(prompt_logprobs, top_k))
    out: PromptLogprobs = [None]
    for entry in prompt_logprobs:
        token = entry.token_id
        scored = {
            token: PromptLogprob(
                logprob=_clamp(entry.logprob), rank=entry.rank, decoded_token=strings.get(token, "")
            )
        }
        for rank, top in enumerate(entry.top[:top_k], start=1):
            scored.setdefault(
                top.token_id,
                PromptLogprob(
                    logprob=_clamp(top.logprob), rank=rank, decoded_token=strings.get(top.token_id, "")
                ),
            )
        out.append(scored)
    return out
