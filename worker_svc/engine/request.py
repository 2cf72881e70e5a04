"""Engine-side request state."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from worker_svc.engine.multimodal import MultiModalInput
from worker_svc.engine.sampling import SamplingParams, TokenLogprob

__all__ = ["FINISH_REASONS", "Request", "RequestSpec", "RequestStatus"]

# Arrival order tie-breaker: monotonic even when two requests share a clock tick.
_ARRIVAL_SEQ = itertools.count()


class RequestStatus(enum.Enum):
    """Lifecycle of a request inside the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_MOVED = "finished_moved"

    @property
    def is_finished(self) -> bool:
        """True for the four terminal states (compared by identity: hashing an enum member
        runs Python code, and this is read for every row of every step)."""
        return (
            self is RequestStatus.FINISHED_STOPPED
            or self is RequestStatus.FINISHED_LENGTH
            or (self is RequestStatus.FINISHED_ABORTED)
            or (self is RequestStatus.FINISHED_MOVED)
        )


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    # Ended here to go on elsewhere with its output so far (LLMEngine.moves_streams).
    RequestStatus.FINISHED_MOVED: "moved",
}


@dataclass(frozen=True)
class RequestSpec:
    """What a caller asks the engine to run: the one description of a request to add.

    `LLMEngine.validate_request` / `add_request` and `AsyncLLMEngine.submit` / `generate`
    take it whole, so the fields travel from the caller to the engine thread as one value.
    Its fields are checked by `LLMEngine.validate_request`, not here: an invalid one must
    come back as the ValueError naming it.

    ``priority``: higher runs first. ``extra_keys`` are mixed into the prompt's block
    hashes (cache salt, ...). ``mm_inputs``: the prompt's images (embeddings for
    placeholder positions). ``resumed_output``: output the request already produced
    elsewhere (mid-stream migration). ``transfer_id`` / ``kv_import_id``: P/D hand-off,
    see `LLMEngine.add_request`. ``lora_name``: the adapter to run it under ("" none).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams
    priority: int = 0
    extra_keys: tuple[str, ...] = ()
    mm_inputs: Sequence[MultiModalInput] = ()
    resumed_output: Sequence[int] = ()
    transfer_id: str | None = None
    kv_import_id: str | None = None
    lora_name: str = ""

    def copied(self) -> RequestSpec:
        """This spec with its sequences copied into tuples: what is handed to another
        thread, which must not see the caller's later changes to its own lists."""
        return replace(
            self,
            prompt_token_ids=tuple(self.prompt_token_ids),
            mm_inputs=tuple(self.mm_inputs),
            resumed_output=tuple(self.resumed_output),
        )


@dataclass(eq=False)
class Request:
    """A sequence being generated.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (it lags
    ``num_tokens`` by the last sampled token during decode and by the rest of the
    prompt during chunked prefill). ``in_flight`` counts sampled tokens a launched step
    has not read back yet (async scheduling, `LLMEngine.step`): ``num_tokens`` counts them,
    so the scheduler gives the request its next row, whose input the model runner takes
    from the device. ``block_table`` lists the KV blocks, in order.
    ``block_hashes`` caches the chained hashes of the request's full token blocks;
    the block manager extends it lazily.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    extra_keys: tuple[str, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = field(default_factory=lambda: next(_ARRIVAL_SEQ))
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    stop_token_id: int | None = None
    num_preemptions: int = 0
    # The scheduler's step count when it last scheduled this request (lower priorities'
    # capped share goes to those that sat out longest).
    last_step: int = 0
    generator: torch.Generator | None = None
    # Prompt logprobs accumulate over prefill chunks; entry i scores prompt token i + 1.
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False
    first_token_time: float | None = None
    # Images of the prompt: embeddings that replace their placeholder positions in prefill.
    mm_inputs: tuple[MultiModalInput, ...] = ()
    # Structured outputs (worker_svc/engine/structured.py): the request's llguidance
    # matcher, advanced by the engine with every accepted token; None = unconstrained.
    grammar: Any = None
    # bad_words as token sequences (the sampler bans a sequence's last token after its prefix).
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # Prefill/decode disaggregation (kv_transfer.py): a prefill-only request keeps its KV
    # blocks pinned under ``transfer_id`` once it finished; a decode request whose prompt
    # KV was imported keeps those blocks pinned under ``kv_import_id`` until it holds them.
    transfer_id: str | None = None
    kv_import_id: str | None = None
    # LoRA adapter the request runs under ("" = the base model); its key is in extra_keys.
    lora_name: str = ""
    # It came with output produced elsewhere (a migration): it is not moved again.
    resumed: bool = False
    in_flight: int = 0

    @property
    def reads_output(self) -> bool:
        """Whether its next draw reads its output's token values on the host (bad words, a
        grammar) or its first token is read on the host (a P/D hand-off): no token of it
        may be in flight then (async scheduling)."""
        return self.transfer_id is not None or self.sampling_params.reads_output

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, those still in flight included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.in_flight

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus generated tokens read back: those whose ids the host has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal status."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason, or None while running."""
        return FINISH_REASONS.get(self.status)

    def token_id(self, position: int) -> int:
        """Token at ``position`` of prompt + output."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without materializing the whole sequence."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
