"""Synchronous engine: schedule -> run -> sample -> update, one call to ``step()`` at a time.

Not thread-safe: use it from one thread (``AsyncLLMEngine`` owns one in a dedicated
thread).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Container, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from services.completion_prompt import first_outside_vocab
from services.kv_contract import with_lora_key, with_mm_keys
from worker_svc.engine import native
from worker_svc.engine.block_manager import BlockManager, KvEvent
from worker_svc.engine.config import EngineConfig, parse_cpu_list, parse_lora_modules
from worker_svc.engine.kv_handoff import KvHandoff
from worker_svc.engine.kv_tier import KvTier, TierStats
from worker_svc.engine.kv_transfer import KvLayout
from worker_svc.engine.lora import LoraManager, LoraSnapshot, LoraStateError, UnknownLoraError
from worker_svc.engine.model_runner import InFlight, ModelInfo, ModelOutput, ModelRunner
from worker_svc.engine.multimodal import MultiModalInput, validate_mm_inputs
from worker_svc.engine.request import Request, RequestSpec, RequestStatus
from worker_svc.engine.sampling import (
    Drawn,
    Sampler,
    SamplerOutput,
    SamplingParams,
    TokenLogprob,
    token_logprobs,
)
from worker_svc.engine.scheduler import ScheduledRequest, StepScheduler
from worker_svc.engine.step_cost import Share, StepCost
from worker_svc.engine.structured import GrammarBackend, Prepared
from worker_svc.engine.token_rate import TokenRate

__all__ = ["EngineStats", "EngineStepError", "LLMEngine", "RequestOutput"]

log = logging.getLogger(__name__)

# Prompt positions scored per log-softmax (bounds its float32 copy: rows x vocabulary).
PROMPT_LOGPROB_ROWS = 128


@dataclass
class RequestOutput:
    """Incremental result of one request for one step.

    ``new_logprobs`` (when requested) has one ``(token_id, logprob, top, rank)`` entry per
    new token; logprobs are those of the raw model distribution. ``stop_token_id`` is
    the EOS or stop token that finished the request (it is also the last entry of
    ``new_token_ids``). ``prompt_logprobs`` comes with the first output only; entry
    ``i`` scores prompt token ``i + 1`` (the first prompt token has no context, so there
    are ``num_prompt_tokens - 1`` entries; OpenAI's format prepends a None).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_token_id: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class EngineStats:
    """Point-in-time engine metrics."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_finished: int
    num_aborted: int
    num_steps: int
    num_generated_tokens: int
    # P/D's estimates (LoadStats): prompt tokens admitted and not computed yet, and the
    # prompt tokens per second of recent steps that computed some (0.0: none yet).
    queued_prompt_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    kv_import_tokens_per_s: float = 0.0
    num_priority_preemptions: int = 0  # of num_preemptions, for a waiting higher priority
    kv_tier_load_tokens_per_s: float = 0.0  # prompt tokens per second loaded from the KV tier
    lora: LoraSnapshot | None = None  # None: LoRA off
    kv_tier: TierStats | None = None  # None: no KV tier


class EngineStepError(RuntimeError):
    """A step failed; ``request_ids`` were in the failed batch and have been aborted."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass
class _Launched:
    """A step whose forward and draw are launched: ``read`` waits for the draw's tensors
    (``drawn``, None when the step samples nothing) and lists them."""

    scheduled: list[ScheduledRequest]
    model_out: ModelOutput
    drawn: Drawn | None
    read: Callable[[], list[list[Any]]]
    started: float

    def in_flight(self) -> InFlight | None:
        """Its tokens on the device, for the next step's inputs (None: none are)."""
        if self.drawn is None:
            return None
        return InFlight(
            self.drawn.tokens, {item.request: i for i, item in enumerate(self.model_out.sample_items)}
        )

    def sampled(self) -> SamplerOutput:
        """Its tokens (and logprobs) read back: waits for the device."""
        return self.drawn.output(self.read()) if self.drawn is not None else SamplerOutput([], [])


class LLMEngine:
    """Continuous-batching LLM engine over a transformers causal LM with a paged KV cache."""

    def __init__(
        self, config: EngineConfig, on_kv_events: Callable[[list[KvEvent]], None] | None = None
    ) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.model_info: ModelInfo = self.runner.info
        self.block_manager = BlockManager(
            self.model_info.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            on_kv_events,
            tier=self._kv_tier(),
        )
        # Fitted only when it sizes lower priorities' share of a step (priority_step_ratio).
        self.step_cost = StepCost() if config.priority_step_ratio else None
        self.scheduler = StepScheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_loras,
            lower_share=self._lower_share if config.priority_step_ratio else None,
        )
        self.sampler = Sampler(self.model_info.vocab_size, self.model_info.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # abort notices, returned by the next step()
        # A P/D prefill worker's: its short streams move before a long prefill (`_move_streams`).
        self.moves_streams = False
        self._eos = frozenset(self.model_info.eos_token_ids)
        self.num_finished = 0
        self.num_aborted = 0
        self.num_steps = 0
        self.num_generated_tokens = 0
        # Async scheduling (EngineConfig.async_scheduling): the step whose tokens are still on
        # the device (`step`), and when the last step was read back (its time, for step_cost).
        self.runs_ahead = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.runner.launches_async
        )
        self._ahead: _Launched | None = None
        self._completed_at = 0.0
        self.prefill_rate = TokenRate()
        self._prefill_left = 0  # prompt tokens the last step's prefill chunks left for later
        self._cpus = parse_cpu_list(config.cpu_affinity)
        self._pinned_thread: int | None = None
        # Structured outputs / bad_words hook: such requests wait here (not in the
        # scheduler) while their matcher is built off this thread (structured.py).
        self.grammar = GrammarBackend(config.model_dir, self.model_info.vocab_size)
        self._preparing: list[tuple[Request, Future[Prepared]]] = []
        self.failed: list[tuple[str, Exception]] = []  # preparations that failed, taken by the caller
        for name, path in parse_lora_modules(config.lora_modules).items():
            self.load_lora(name, path)
        # P/D disaggregation: KV held for export (prefill role) and imported KV (decode role).
        self.kv = KvHandoff(
            self.block_manager,
            self.runner.read_block,
            self.runner.write_block,
            self.kv_layout(),
            config.kv_transfer_ttl_s,
        )

    def kv_layout(self, model: str | None = None) -> KvLayout:
        """What a KV block of this engine holds. ``model``: the served model's name (the
        worker's; by default the model directory's name)."""
        info = self.model_info
        name = model or os.path.basename(os.path.normpath(info.model_dir))
        return KvLayout(name, info.dtype, info.num_layers, info.num_kv_heads, info.head_dim, info.block_size)

    # ------------------------------------------------------------ requests
    def validate_request(self, spec: RequestSpec) -> None:
        """Stateless checks of a request (safe to call from any thread); ValueError names the field."""
        if not isinstance(spec.request_id, str) or not spec.request_id:
            raise ValueError("request_id must be a non-empty string")
        params = spec.sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        params.validate()
        params.validate_vocab(self.model_info.vocab_size)
        prompt = spec.prompt_token_ids
        _validate_prompt(prompt, self.model_info.vocab_size)
        if isinstance(spec.priority, bool) or not isinstance(spec.priority, int):
            raise ValueError(f"priority must be an int, got {spec.priority!r}")
        if not isinstance(spec.extra_keys, tuple) or not all(isinstance(k, str) for k in spec.extra_keys):
            raise ValueError("extra_keys must be a tuple of strings")
        info = self.model_info
        if spec.mm_inputs:
            validate_mm_inputs(spec.mm_inputs, len(prompt), info.hidden_size)
        if spec.resumed_output:
            _validate_resumed(spec.resumed_output, info.vocab_size, params.max_tokens)
        total = len(prompt) + params.max_tokens
        if total > info.max_model_len:
            raise ValueError(
                f"prompt_token_ids ({len(prompt)} tokens) + max_tokens "
                f"({params.max_tokens}) = {total} exceeds max_model_len={info.max_model_len}"
            )
        blocks = -(-total // info.block_size)
        if blocks > info.num_kv_blocks:
            raise ValueError(
                f"request needs {blocks} KV blocks but the cache has only num_kv_blocks={info.num_kv_blocks}"
            )

    def add_request(self, spec: RequestSpec, *, validated: bool = False) -> None:
        """Queue a request; raises ValueError (naming the field) if it is invalid.

        ``spec.mm_inputs`` are the prompt's images (embeddings for placeholder positions);
        their identifiers are mixed into the block hashes (``mm:<identifier>`` extra keys).
        ``spec.resumed_output`` is output the request already produced elsewhere
        (mid-stream migration): it is computed like a preempted request's, counts as output
        (max/min tokens, penalties, seeded draws) and is not sent again. ``validated``: the
        caller has already run `validate_request` on it (the async front does, in the
        caller's thread, off the engine thread's path to its step); only the checks that
        need the engine's state are left.

        ``spec.transfer_id`` makes it prefill-only (P/D): it computes the prompt's KV and
        its first token, then its blocks stay pinned under that id for export (``self.kv``)
        instead of being freed. ``spec.kv_import_id``: the prompt's KV was imported under
        that id (``self.kv.import_blocks``); those blocks stay pinned until the request has
        taken them as prefix-cache hits.
        """
        if not validated:
            self.validate_request(spec)
        if spec.request_id in self.requests:
            raise ValueError(f"request_id {spec.request_id!r} is already in use")
        params = spec.sampling_params
        if spec.transfer_id is not None:
            _validate_prefill_only(
                spec.transfer_id, params, spec.mm_inputs, spec.resumed_output, self.kv.held
            )
        if spec.lora_name and not (self.lora is not None and self.lora.known(spec.lora_name)):
            raise UnknownLoraError(f"LoRA adapter {spec.lora_name!r} is not loaded")
        request = self._new_request(spec)
        self.requests[spec.request_id] = request
        if params.structured is not None or params.bad_words:
            # Structured-outputs hook: scheduled once its matcher is ready (_admit_prepared).
            future = self.grammar.prepare(params.structured, params.bad_words, spec.resumed_output)
            self._preparing.append((request, future))
            return
        self.scheduler.add(request)

    def _new_request(self, spec: RequestSpec) -> Request:
        """The engine's state for a validated spec (copies of its sequences, its seeded draws)."""
        params = spec.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        return Request(
            request_id=spec.request_id,
            prompt_token_ids=list(spec.prompt_token_ids),
            sampling_params=params,
            priority=spec.priority,
            extra_keys=with_mm_keys(with_lora_key(spec.extra_keys, spec.lora_name), spec.mm_inputs),
            generator=generator,
            mm_inputs=tuple(spec.mm_inputs),
            output_token_ids=list(spec.resumed_output),
            transfer_id=spec.transfer_id,
            kv_import_id=spec.kv_import_id,
            lora_name=spec.lora_name,
            resumed=bool(spec.resumed_output),
        )

    def abort_request(self, request_id: str) -> bool:
        """Abort an unfinished request and free its blocks now; False if unknown/finished.

        An ``abort`` RequestOutput for it is returned by the next ``step()``.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if not self._drop_preparing(request):
            self.scheduler.remove(request)
        self._release_import(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self.num_aborted += 1
        self._pending.append(self._output(request, [], None))
        return True

    # ---------------------------------------------------------------- LoRA
    @property
    def lora(self) -> LoraManager | None:
        """The adapters (None when the engine runs with ``max_loras=0``)."""
        return self.runner.lora

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at ``path`` as ``name`` (into the CPU cache; a slot is
        taken when a step needs it). LoraError (a ValueError) when the adapter does not
        fit the base model (nothing else changes then), LoraStateError when LoRA is off."""
        if self.lora is None:
            raise LoraStateError(f"cannot load LoRA adapter {name!r}: LoRA is not enabled (max_loras=0)")
        self.lora.register(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``; UnknownLoraError when it is not loaded, LoraStateError
        while requests use it."""
        if self.lora is None or not self.lora.known(name):
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded")
        users = [r.request_id for r in self.requests.values() if r.lora_name == name]
        if users:
            raise LoraStateError(f"LoRA adapter {name!r} is in use by {len(users)} request(s)")
        self.lora.unregister(name)

    # ------------------------------------------------- structured outputs hook
    def _drop_preparing(self, request: Request) -> bool:
        """Forget a request still waiting for its matcher; False if it is not waiting."""
        for i, (waiting, future) in enumerate(self._preparing):
            if waiting is request:
                future.cancel()
                del self._preparing[i]
                return True
        return False

    def _admit_prepared(self) -> None:
        """Requests whose matcher is ready enter the scheduler; a failed preparation
        ends its request with that error (``failed``, delivered by the async engine).
        Waits briefly when nothing else could run (no busy loop)."""
        if not self._preparing:
            return
        if not self.scheduler.has_unfinished() and not self._pending:
            wait_futures([f for _, f in self._preparing], timeout=0.005, return_when=FIRST_COMPLETED)
        still: list[tuple[Request, Future[Prepared]]] = []
        for request, future in self._preparing:
            if not future.done():
                still.append((request, future))
                continue
            try:
                prepared = future.result()
            except Exception as exc:  # this request's error (in `failed`), the engine goes on
                log.warning("request %s: structured outputs failed: %s", request.request_id, exc)
                self.requests.pop(request.request_id, None)
                request.status = RequestStatus.FINISHED_ABORTED
                self.failed.append((request.request_id, exc))
                continue
            request.grammar, request.bad_words_ids = prepared.matcher, prepared.bad_words_ids
            self.scheduler.add(request)
        self._preparing = still

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has work (requests, a step in flight, or abort notices to deliver)."""
        return (
            self.scheduler.has_unfinished()
            or self._ahead is not None
            or bool(self._pending)
            or bool(self._preparing)
        )

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (only while no request holds blocks)."""
        ok = self.block_manager.reset_prefix_cache()
        self.block_manager.flush_events()
        return ok

    def warm_up(self) -> float:
        """Readies every step shape before the worker reports ready, so that no user's request
        pays for it: a compiled model compiles now, and a step size a CPU step is padded to
        (``ModelRunner.step_sizes``) gets its kernels built. One compiled graph serves every
        step: one prompt alone (prefill: many tokens, one row; decode: one and one), then two
        together (many tokens and rows), the same graph each time, which a warm-up checks
        rather than assumes; then the prefix cache it filled is emptied. On a GPU the
        sampler's kernels are built too. Returns the seconds it took. A model the compiler
        fails on is served eagerly (a warning, and the start-up log says why): slower,
        never wrong."""
        self.sampler.warm_up(self.runner.device, self.runner.dtype)
        if not (self.config.compiles or self.runner.step_sizes):
            return 0.0
        start = time.monotonic()
        if self.config.compiles:
            self._compile_steps()
            if not self.runner.compile_failed:
                log.info("forward compiled in %.0f s", time.monotonic() - start)
        if self.runner.step_sizes:
            log.info("building the kernels of %d step sizes", len(self.runner.step_sizes))
        self.runner.warm_step_sizes()
        self.prefill_rate.reset()  # warm-up steps compiled and built kernels: not a rate
        return time.monotonic() - start

    def _compile_steps(self) -> None:
        try:
            self._warm_up_steps()
        except Exception as exc:
            cause = exc.cause if isinstance(exc, EngineStepError) else exc
            log.warning("compiling the forward failed, serving it eagerly: %r", cause)
            self.runner.stop_compiling(f"compile failed: {type(cause).__name__}")
            for request_id in list(self.requests):
                self.abort_request(request_id)
            while self.has_unfinished():
                self.step()
        self.num_finished = self.num_steps = self.num_generated_tokens = self.num_aborted = 0
        self.reset_prefix_cache()

    def _warm_up_steps(self) -> None:
        for batch in ((("warm-up-0", 9, 2),), (("warm-up-1", 3, 2), ("warm-up-2", 9, 4))):
            for name, prompt_len, max_tokens in batch:
                ids = [i % self.model_info.vocab_size for i in range(1, prompt_len + 1)]
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                self.add_request(RequestSpec(name, ids, params))
            while self.has_unfinished():
                self.step()

    def describe(self) -> str:
        """The engine's effective configuration in one line, for the start-up log."""
        info, config = self.model_info, self.config
        defaults = ", ".join(f"{k}={v}" for k, v in info.sampling_defaults) or "none"
        return (
            f"dtype {info.dtype}, attention {info.attention_backend}, compiled {self._compile_summary()}, "
            f"native CPU kernels {self._native_summary()}, CUDA graphs {self._graphs_summary()}, "
            f"{len(self.runner.merged)} merged projection groups, "
            f"{torch.get_num_threads()} threads, {info.num_kv_blocks} KV blocks of {info.block_size} tokens, "
            f"max_model_len {info.max_model_len}, max_num_seqs {config.max_num_seqs}, "
            f"{config.max_num_batched_tokens} tokens per step, "
            f"prefix caching {config.enable_prefix_caching}, model sampling defaults: {defaults}"
        )

    def _compile_summary(self) -> str:
        skipped = self.config.compile_skipped() or self.runner.compile_failed
        return f"no ({skipped})" if skipped else f"yes ({self.runner.compile_seconds:.1f} s)"

    def _native_summary(self) -> str:
        if self.runner.device.type != "cpu":
            return "n/a"
        return "yes" if native.library() is not None else "no (no C compiler, or the build failed)"

    def _graphs_summary(self) -> str:
        graphs = self.runner.graphs
        if graphs is None:
            return f"off ({self.runner.graphs_note})"
        return (
            f"{len(graphs.buckets)} buckets up to {graphs.buckets[-1]} ({graphs.capture_s:.1f} s to capture)"
        )

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration and return the outputs it produced.

        With async scheduling (``runs_ahead``) a step whose tokens are drawn on the device
        stays in flight: the next call schedules and launches the following step, then
        reads those tokens back and returns their outputs (docs/design-decisions.md,
        "Async scheduling"). On a model/sampler failure the requests of the failed batch
        are aborted (blocks freed) and :class:`EngineStepError` is raised; the engine
        stays usable.
        """
        if self._cpus and self._pinned_thread != threading.get_ident():
            self._pinned_thread = threading.get_ident()
            _pin_current_thread(self._cpus)
        self._admit_prepared()
        if self.kv.held:
            self.kv.expire()
        outputs, self._pending = self._pending, []
        if self.moves_streams and (moved := self._move_streams()):
            self.block_manager.flush_events()
            return outputs + moved  # before the long prefill's first step, not after it
        sched = self.scheduler.schedule()
        ahead, self._ahead = self._ahead, None
        launched = self._launch(sched.scheduled, ahead, outputs) if sched.scheduled else None
        if ahead is not None:
            try:
                outputs.extend(self._complete(ahead))
            except EngineStepError as exc:  # the device failed: the step launched after it too
                if launched is not None:
                    exc.request_ids.extend(
                        self._fail([i for i in launched.scheduled if not i.request.is_finished])
                    )
                self._pending = outputs + self._pending
                raise
        if launched is not None:
            if self._may_stay_in_flight(launched):
                self._ahead = launched
            else:
                outputs.extend(self._complete(launched))
        self.block_manager.flush_events()
        return outputs

    @property
    def step_in_flight(self) -> bool:
        """Whether a launched step's tokens are still to be read back (async scheduling)."""
        return self._ahead is not None

    def _may_stay_in_flight(self, launched: _Launched) -> bool:
        """Whether ``launched`` may be read back after the next step's launch: nothing of
        it is read on the host before (prompt logprobs, a P/D hand-off's first token, a
        prefill worker's moves), and none of its requests' next draws reads their output's
        token values on the host (bad words, grammars: `Request.reads_output`)."""
        return (
            self.runs_ahead
            and launched.drawn is not None
            and not launched.model_out.prompt_logits
            and not self.moves_streams
            and not any(item.request.reads_output for item in launched.model_out.sample_items)
        )

    def _launch(
        self, scheduled: list[ScheduledRequest], ahead: _Launched | None, outputs: list[RequestOutput]
    ) -> _Launched:
        """Runs the step's forward and, where every row is drawn from its logits as they
        come, its draw, without waiting for the device; each sampled request then has a
        token in flight. ``ahead``: the step still in flight, whose tokens are inputs of
        this one. On failure that step is read back first, its outputs into ``outputs``."""
        self.num_steps += 1
        for item in scheduled:
            if item.request.kv_import_id is not None:  # it holds the imported blocks now
                self._release_import(item.request)
        started = time.perf_counter()
        try:
            in_flight = ahead.in_flight() if ahead is not None else None
            model_out = self.runner.execute(scheduled, in_flight)
            rows = [item.request for item in model_out.sample_items]
            drawn = self.sampler.launch(model_out.sample_logits, rows, in_flight) if rows else None
        except Exception as exc:
            if ahead is not None:
                outputs.extend(self._complete(ahead))
            self._pending = outputs + self._pending
            failed = self._fail([item for item in scheduled if not item.request.is_finished])
            self.block_manager.flush_events()
            raise EngineStepError(failed, exc) from exc
        for item in scheduled:
            item.request.num_computed_tokens = item.end
        for request in rows:
            request.in_flight += 1
        read = self.runner.start_readback(drawn.tensors() if drawn is not None else [])
        return _Launched(scheduled, model_out, drawn, read, started)

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Reads a launched step's tokens back (waiting for the device) and applies them:
        blocks it filled registered, outputs of the requests still unfinished."""
        model_out = launched.model_out
        try:
            sampled = launched.sampled()
            self._record_prompt_logprobs(model_out)
        except Exception as exc:
            for item in model_out.sample_items:
                item.request.in_flight -= 1
            failed = self._fail([item for item in launched.scheduled if not item.request.is_finished])
            self.block_manager.flush_events()
            raise EngineStepError(failed, exc) from exc
        block_size = self.block_manager.block_size
        for item in launched.scheduled:
            # A decode row fills a block only at a block's last slot: else nothing to register.
            if (item.num_new_tokens > 1 or item.end % block_size == 0) and (
                item.request.status is RequestStatus.RUNNING
            ):
                self.block_manager.mark_computed(item.request)
        now = time.perf_counter()
        seconds = now - max(launched.started, self._completed_at)
        self._completed_at = now
        self._measure_prefill(launched.scheduled, seconds)
        if self.step_cost is not None:
            self.step_cost.add(
                len(launched.scheduled), sum(i.num_new_tokens for i in launched.scheduled), seconds
            )
        return self._apply_samples(model_out.sample_items, sampled)

    def _move_streams(self) -> list[RequestOutput]:
        """A P/D prefill worker taking whole requests (``moves_streams``): while a long
        prompt waits or is in chunked prefill, its short requests that are decoding end
        here as "moved" (blocks freed), and their clients go on with them on a decoder,
        the output so far resumed there. Left here, each of their tokens would wait for a
        chunk step of that prefill, and prefill workers compute long prompts back to back
        (docs/design-decisions.md, "P/D: prefill workers also take whole requests").
        Short: a prompt of at most `StepScheduler.short_prompt_tokens`, and with its output
        within one step's budget, which the decoder recomputes. A request that came with
        output made elsewhere (one moved here again, for want of a decoder) stays."""
        sched = self.scheduler
        short = sched.short_prompt_tokens
        if all(
            r.num_prompt_tokens - r.num_computed_tokens <= short for r in chain(sched.waiting, sched.running)
        ):
            return []
        moved = []
        for request in list(sched.running):
            if (
                request.num_computed_tokens >= request.num_prompt_tokens
                and request.num_prompt_tokens <= short
                and request.num_tokens <= sched.max_num_batched_tokens
                and not request.resumed
                and request.transfer_id is None
                and not request.mm_inputs
            ):
                request.status = RequestStatus.FINISHED_MOVED
                moved.append(self._output(request, [], None))
                self._finish(request)
        return moved

    def _lower_share(self, rows: int, tokens: int) -> Share | None:
        """What lower priorities may add to a step in which the highest running priority
        computes ``rows`` and ``tokens``: the step then takes at most
        ``priority_step_ratio`` times what those alone would (StepScheduler; None until
        steps have been measured)."""
        if self.step_cost is None:
            return None
        return self.step_cost.share(rows, tokens, self.config.priority_step_ratio)

    def _measure_prefill(self, scheduled: list[ScheduledRequest], seconds: float) -> None:
        """The step's tokens of long prompts into the prefill rate, and what its chunked
        prompts left for later steps. Short prompts (the scheduler's: a quarter of a step at
        most) are left out: their tokens attend over little context and share a step with
        its fixed cost, so a rate of theirs misprices the long prompts the rate is used to
        place (docs/design-decisions.md, "A prefill rate of long prompts")."""
        chunks = [item for item in scheduled if item.num_new_tokens > 1]
        self._prefill_left = sum(item.request.num_tokens - item.end for item in chunks)
        short = self.scheduler.short_prompt_tokens
        tokens = sum(item.num_new_tokens for item in chunks if item.request.num_prompt_tokens > short)
        if tokens:
            self.prefill_rate.add(tokens, seconds)

    def _fail(self, scheduled: list[ScheduledRequest]) -> list[str]:
        failed = []
        for item in scheduled:
            request = item.request
            self.scheduler.remove(request)
            self._release_import(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self.requests.pop(request.request_id, None)
            self.num_aborted += 1
            failed.append(request.request_id)
        return failed

    def _record_prompt_logprobs(self, model_out: ModelOutput) -> None:
        """Prompt logprobs of this step's chunks (requests that asked for them): each chunk's
        rows are scored ``PROMPT_LOGPROB_ROWS`` at a time, so the float32 log-softmax of a
        long prompt is never held at full vocabulary beyond that many rows."""
        for item, logits in model_out.prompt_logits:
            request = item.request
            if request.prompt_logprobs is None:
                request.prompt_logprobs = []
            # Row r holds the logits at position start + r, which predict token start + r + 1;
            # entry j of prompt_logprobs scores token j + 1, i.e. comes from position j.
            first = len(request.prompt_logprobs) - item.start
            last = min(item.end, request.num_prompt_tokens - 1) - item.start
            if first < 0:  # a gap: the prefix cache must not serve such a request
                raise RuntimeError(f"request {request.request_id}: prompt logprobs miss positions")
            k = request.sampling_params.prompt_logprobs or 0
            for a in range(first, last, PROMPT_LOGPROB_ROWS):  # empty when already recorded
                b = min(a + PROMPT_LOGPROB_ROWS, last)
                lps = torch.log_softmax(logits[a:b].float(), dim=-1)
                targets = request.prompt_token_ids[item.start + a + 1 : item.start + b + 1]
                request.prompt_logprobs.extend(token_logprobs(lps, targets, [k] * len(targets)))

    def _apply_samples(self, items: list[ScheduledRequest], sampled: SamplerOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        running = RequestStatus.RUNNING
        for item, token, logprob in zip(items, sampled.token_ids, sampled.logprobs, strict=True):
            request = item.request
            request.in_flight -= 1
            status = request.status
            if status is not running and status.is_finished:
                continue  # aborted, or stopped at the token before (async scheduling)
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            if request.grammar is None or self._advance_grammar(request, token):
                self._check_stop(request, token)
            output = self._output(request, [token], [logprob] if logprob is not None else None)
            outputs.append(output)
            if output.finished:
                self._finish(request)
        self.num_generated_tokens += len(outputs)
        return outputs

    def _finish(self, request: Request) -> None:
        if request.transfer_id is not None and request.status is not RequestStatus.FINISHED_ABORTED:
            self.scheduler.detach(request)  # its blocks stay pinned for the transfer
            self.kv.hold(request)
        else:
            self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)
        self.num_finished += 1

    def _release_import(self, request: Request) -> None:
        if request.kv_import_id is not None:
            self.kv.release_import(request.kv_import_id)
            request.kv_import_id = None

    def _advance_grammar(self, request: Request, token: int) -> bool:
        """Structured outputs hook: the matcher sees each accepted token exactly once.
        A token it refuses (only possible when other rules, e.g. allowed_token_ids,
        left no token the grammar allows) aborts this request, not the batch."""
        if request.grammar is None or request.grammar.consume_token(token):
            return True
        log.warning(
            "request %s: token %d violates its grammar (%s); aborted",
            request.request_id,
            token,
            request.grammar.get_error()[:200],
        )
        request.status = RequestStatus.FINISHED_ABORTED
        return False

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens and (
            (not params.ignore_eos and token in self._eos) or token in params.stop_token_ids
        ):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_token_id = token
        elif request.grammar is not None and request.grammar.is_stopped():
            # The grammar is complete and allows nothing more: the output is whole.
            request.status = RequestStatus.FINISHED_STOPPED
        elif (
            num_output >= params.max_tokens
            or len(request.prompt_token_ids) + num_output >= self.model_info.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH

    def _output(
        self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None
    ) -> RequestOutput:
        prompt_lps = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent and tokens:
            prompt_lps = request.prompt_logprobs
            request.prompt_logprobs_sent = True
        finished = request.status.is_finished
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            stop_token_id=request.stop_token_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            prompt_logprobs=prompt_lps,
        )

    def _kv_tier(self) -> KvTier | None:
        """The KV tier the config asks for (None: none)."""
        config = self.config
        block_bytes = self.kv_layout().block_bytes
        capacity = config.kv_tier_mb * (1 << 20) // block_bytes
        if capacity <= 0:
            return None
        return KvTier(
            capacity,
            block_bytes,
            self.runner.read_block,
            self.runner.write_block,
            config.kv_tier_admit_after,
            config.kv_tier_path,
        )

    # --------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        """Current counters and KV cache usage."""
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=bm.usage(),
            num_free_blocks=bm.num_free_blocks(),
            num_total_blocks=bm.num_total_blocks,
            prefix_cache_hit_rate=bm.prefix_hit_rate(),
            num_preemptions=self.scheduler.num_preemptions,
            num_finished=self.num_finished,
            num_aborted=self.num_aborted,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            queued_prompt_tokens=self._prefill_left
            + sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting),
            prefill_tokens_per_s=self.prefill_rate.per_s,
            kv_import_tokens_per_s=self.kv.import_rate.per_s,
            num_priority_preemptions=self.scheduler.num_priority_preemptions,
            kv_tier_load_tokens_per_s=bm.tier_load_rate.per_s,
            lora=self.lora.snapshot() if self.lora is not None else None,
            kv_tier=dataclasses.replace(bm.tier.stats, blocks=len(bm.tier)) if bm.tier is not None else None,
        )


def _pin_current_thread(cpus: frozenset[int]) -> None:
    """Pin the calling thread (pid 0 = this thread on Linux): the engine's compute thread
    then keeps its caches and is not migrated onto the cores the servers use."""
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError) as exc:  # not Linux, or CPUs outside this cgroup
        log.warning("cpu_affinity %s not applied: %s", sorted(cpus), exc)


def _validate_prefill_only(
    transfer_id: str,
    params: SamplingParams,
    mm_inputs: Sequence[MultiModalInput],
    resumed_output: Sequence[int],
    held: Container[str],
) -> None:
    """A prefill-only request computes a text prompt and one token, under a new id."""
    if not isinstance(transfer_id, str) or not transfer_id:
        raise ValueError("transfer_id must be a non-empty string")
    if transfer_id in held:
        raise ValueError(f"transfer_id {transfer_id!r} is already held")
    if params.max_tokens != 1 or mm_inputs or resumed_output or params.prompt_logprobs is not None:
        raise ValueError(
            "a prefill-only request (transfer_id) takes a text prompt, max_tokens=1, no prompt_logprobs"
        )


def _validate_resumed(tokens: Sequence[int], vocab_size: int, max_tokens: int) -> None:
    if len(tokens) >= max_tokens:
        raise ValueError(
            f"resumed output has {len(tokens)} tokens: max_tokens={max_tokens} leaves none to generate"
        )
    _check_in_vocab("resumed output", tokens, vocab_size)


def _validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    if isinstance(prompt_token_ids, str | bytes) or not isinstance(prompt_token_ids, Sequence):
        raise ValueError("prompt_token_ids must be a sequence of ints")
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    _check_in_vocab("prompt_token_ids", prompt_token_ids, vocab_size)


def _check_in_vocab(name: str, tokens: Sequence[int], vocab_size: int) -> None:
    """ValueError naming `name` for the first entry that is not a token id of the vocabulary."""
    bad = first_outside_vocab(tokens, vocab_size)
    if bad is not None:
        raise ValueError(f"{name} contains {bad[1]!r}, outside the vocabulary [0, {vocab_size})")
