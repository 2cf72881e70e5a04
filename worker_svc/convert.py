"""Proto ↔ engine conversions for the decoder worker (no grpc here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshserve.v1 import common_pb2
from services.errors import InvalidArgument
from services.grammar import StructuredSpec
from services.sampling_fields import OPTIONAL_SAMPLING_FIELDS
from worker_svc.engine.engine import RequestOutput
from worker_svc.engine.sampling import SamplingParams, TokenLogprob

# `n` is not a sampling parameter of one sequence: the worker runs n of them.
_OPTIONAL_FIELDS = tuple(name for name in OPTIONAL_SAMPLING_FIELDS if name != "n")

FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
    "moved": common_pb2.FINISH_REASON_MOVED,
}


def num_samples(sampling: common_pb2.SamplingParams, max_n: int = 64) -> int:
    """OpenAI `n`: parallel samples of one prompt (1 when unset)."""
    n = sampling.n if sampling.HasField("n") else 1
    if not 1 <= n <= max_n:
        raise ValueError(f"n must be in 1..{max_n}, got {n}")
    return n


def sampling_params(
    sampling: common_pb2.SamplingParams,
    prompt_len: int,
    max_model_len: int,
    sample_index: int = 0,
    defaults: Sequence[tuple[str, float]] = (),
) -> SamplingParams:
    """Engine params from the proto: unset fields take ``defaults`` (the model's generation
    config, ``ModelInfo.sampling_defaults``), else the engine's own, except max_tokens,
    which defaults to the rest of the context window (as vLLM does)."""
    kwargs: dict[str, Any] = dict(defaults)
    for name in _OPTIONAL_FIELDS:
        if sampling.HasField(name):
            kwargs[name] = getattr(sampling, name)
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = max(max_model_len - prompt_len, 1)
    # Parallel samples with a seed must differ from each other yet stay reproducible.
    if "seed" in kwargs and sample_index:
        kwargs["seed"] = kwargs["seed"] + sample_index
    kwargs["stop_token_ids"] = tuple(sampling.stop_token_ids)
    kwargs["ignore_eos"] = sampling.ignore_eos
    kwargs.update(token_rules(sampling))
    params = SamplingParams(**kwargs)
    try:
        params.validate()
    except ValueError as exc:
        # The message starts with the field ("structured_outputs.json is invalid: ...").
        field = str(exc).split(" ", 1)[0].split(".", 1)[0]
        raise InvalidArgument(str(exc), param=field) from None
    return params


def token_rules(sampling: common_pb2.SamplingParams) -> dict[str, Any]:
    """logit_bias, allowed_token_ids, bad_words and structured outputs as engine kwargs."""
    kwargs: dict[str, Any] = {
        "logit_bias": tuple(sorted(sampling.logit_bias.items())),
        "allowed_token_ids": tuple(sampling.allowed_token_ids),
        "bad_words": tuple(sampling.bad_words),
    }
    if sampling.HasField("structured_kind"):
        kwargs["structured"] = StructuredSpec(sampling.structured_kind, sampling.structured_spec)
    return kwargs


def resumed_outputs(
    resumed: Sequence[common_pb2.ResumedOutput], n: int
) -> dict[int, common_pb2.ResumedOutput]:
    """`GenerateRequest.resumed` by choice index; InvalidArgument for a bad or repeated
    index, or when every choice has already finished (nothing left to run)."""
    by_index: dict[int, common_pb2.ResumedOutput] = {}
    for item in resumed:
        if not 0 <= item.index < n or item.index in by_index:
            raise InvalidArgument(
                f"resumed index {item.index} is out of range or repeated (n={n})", param="resumed"
            )
        by_index[item.index] = item
    if len(by_index) == n and all(item.finished for item in by_index.values()):
        raise InvalidArgument("every choice in resumed has finished: nothing to generate", param="resumed")
    return by_index


def child_ids(request_id: str, n: int) -> list[str]:
    """Engine request ids of a request's parallel samples (the request id itself for n=1)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def validate_mm_items(request: common_pb2.GenerateRequest) -> None:
    """Every image's placeholder run must lie inside the prompt."""
    num_tokens = len(request.prompt_token_ids)
    for i, item in enumerate(request.mm_items):
        if item.offset < 0 or item.length < 0 or item.offset + item.length > num_tokens:
            raise InvalidArgument(
                f"mm_items[{i}] (offset {item.offset}, length {item.length}) lies outside the "
                f"{num_tokens}-token prompt",
                param="mm_items",
            )


def _logprobs(entries: list[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    """Engine (token, logprob, top, rank) entries as proto messages."""
    return [
        common_pb2.TokenLogprob(
            token_id=token_id,
            logprob=logprob,
            top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
            rank=rank,
        )
        for token_id, logprob, top, rank in entries or ()
    ]


def sequence_delta(index: int, out: RequestOutput) -> common_pb2.SequenceDelta:
    delta = common_pb2.SequenceDelta(
        index=index,
        token_ids=out.new_token_ids,
        logprobs=_logprobs(out.new_logprobs),
        finish_reason=FINISH_REASONS.get(out.finish_reason, common_pb2.FINISH_REASON_ERROR),
    )
    if out.stop_token_id is not None:
        delta.stop_token_id = out.stop_token_id
    return delta


def prompt_logprobs(out: RequestOutput) -> list[common_pb2.TokenLogprob]:
    return _logprobs(out.prompt_logprobs)
