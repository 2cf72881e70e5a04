"""Request body -> proto conversion: the request id, the context-length rule (max_tokens),
the SamplingParams of the fields the client set, and each prompt's GenerationSpec."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from gateway import structured
from gateway.classes import DEFAULT, Resolved
from gateway.errors import APIError
from gateway.generation import GenerationSpec
from gateway.protocol import SamplingRequest
from meshserve.v1 import common_pb2
from services.sampling_fields import OPTIONAL_SAMPLING_FIELDS

if TYPE_CHECKING:
    from gateway.serving import RequestContext

# Sampling fields forwarded only when the client set them; the others are set below.
_CLIENT_SET_SAMPLING = tuple(
    name
    for name in OPTIONAL_SAMPLING_FIELDS
    if name not in ("max_tokens", "n", "logprobs", "prompt_logprobs")
)


def new_id(prefix: str) -> str:
    """A request id such as `chatcmpl-<hex>`; also the scheduler's request_id."""
    return f"{prefix}-{uuid.uuid4().hex}"


def resolve_max_tokens(
    prompt_len: int,
    requested: int | None,
    max_model_len: int,
    default: int,
    prompt_param: str,
    max_param: str = "max_tokens",
) -> int:
    """max_tokens to ask for, or a 400 naming the model's context length."""
    if max_model_len <= 0:  # unknown limit: let the worker enforce it
        return requested if requested is not None else default
    limit = f"This model's maximum context length is {max_model_len} tokens; your request has {prompt_len} prompt tokens"
    if requested is None and prompt_len >= max_model_len:
        raise APIError(
            400,
            f"{limit}, which leaves no room for completion tokens. Please reduce the length of the {prompt_param}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is not None and prompt_len + requested > max_model_len:
        raise APIError(
            400,
            f"{limit} and asks for {requested} completion tokens ({prompt_len + requested} in total). "
            f"Please reduce the length of the {prompt_param} or {max_param}.",
            param=prompt_param if prompt_len >= max_model_len else max_param,
            code="context_length_exceeded",
        )
    if requested is not None:
        return requested
    return min(default, max_model_len - prompt_len)


def sampling_params(
    body: SamplingRequest, max_tokens: int, logprobs: int | None
) -> common_pb2.SamplingParams:
    """SamplingParams with only the fields the client set (plus max_tokens and n)."""
    params = common_pb2.SamplingParams(max_tokens=max_tokens, n=body.n, ignore_eos=body.ignore_eos)
    for name in _CLIENT_SET_SAMPLING:
        value = getattr(body, name)
        if name in body.model_fields_set and value is not None:
            setattr(params, name, value)
    if body.stop_token_ids:
        params.stop_token_ids.extend(body.stop_token_ids)
    if logprobs is not None:
        params.logprobs = logprobs
    if body.prompt_logprobs is not None:
        params.prompt_logprobs = body.prompt_logprobs
    add_token_rules(body, params)
    return params


def add_token_rules(body: SamplingRequest, params: common_pb2.SamplingParams) -> None:
    """logit_bias, allowed_token_ids, bad_words and the output constraint (checked
    here: a bad schema is a 400 naming the field before anything is routed)."""
    for token, bias in body.logit_bias_ids().items():
        params.logit_bias[token] = bias
    if body.allowed_token_ids:
        params.allowed_token_ids.extend(body.allowed_token_ids)
    if body.bad_words:
        params.bad_words.extend(body.bad_words)
    found = structured.constraint(body)
    if found is not None:
        kind, spec, param = found
        structured.check(kind, spec, param)
        params.structured_kind, params.structured_spec = kind, spec


def generation_spec(
    ctx: RequestContext,
    body: SamplingRequest,
    request_id: str,
    model: str,
    prompt_ids: list[int],
    mm_items: list[common_pb2.MultiModalItem],
    sampling: common_pb2.SamplingParams,
) -> GenerationSpec:
    """The GenerationSpec of one prompt, in its priority class (gateway/classes.py; the
    mesh runs higher priorities first: vLLM's lower-first priority is negated)."""
    if ctx.classes is None:
        klass = Resolved(DEFAULT, -body.priority, None)
    else:
        klass = ctx.classes.resolve(ctx.tenant, body.service_tier, body.priority)
    return GenerationSpec(
        request_id=request_id,
        model=model,
        prompt_ids=prompt_ids,
        mm_items=mm_items,
        sampling=sampling,
        n=body.n,
        stop=body.stop_list(),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        priority=klass.priority,
        tenant=ctx.tenant,
        service_class=klass.name,
        queue_timeout_s=klass.queue_timeout_s,
        cache_salt=body.cache_salt or "",
        constraint_param=_constraint_param(body, sampling),
    )


def _constraint_param(body: SamplingRequest, sampling: common_pb2.SamplingParams) -> str:
    """The request field of the body's output constraint ("" when it has none)."""
    found = structured.constraint(body) if sampling.structured_kind else None
    return found[2] if found is not None else ""
