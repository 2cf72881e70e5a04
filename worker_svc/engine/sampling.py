"""Sampling parameters and the batched sampler.

Processing order for one step (all rows at once where possible):

1. raw log-probs (``log_softmax`` of the model's logits) for rows that asked for
   logprobs. Like vLLM's default (``logprobs_mode="raw_logprobs"``) the reported
   logprobs describe the *model's* distribution, before penalties/temperature/top-k.
2. penalties: repetition (HF semantics, over prompt + output: positive logits are
   divided by the penalty, negative ones multiplied), presence and frequency (OpenAI
   semantics, over output tokens only: ``logit -= freq * count + presence * (count > 0)``),
   from each penalized request's state on the device (:mod:`worker_svc.engine.penalties`).
3. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` are masked.
3b. token rules: ``logit_bias`` is added (OpenAI semantics), tokens outside
   ``allowed_token_ids`` and the last token of any ``bad_words`` sequence whose prefix
   ends the output are masked, and a structured-output row's grammar masks every token
   it does not allow now (``structured.apply_grammar_masks``, one bitmask per step for
   all constrained rows). Rows without any of these skip this entirely.
4. temperature 0 -> greedy argmax of the penalized logits; otherwise divide by
   temperature, apply top-k, top-p, min-p, and draw: an unseeded row by inverse CDF (one
   uniform against the row's running probability mass), a seeded row with the exponential
   race ``argmax(probs / E)``, ``E ~ Exp(1)`` per candidate token. A seeded request draws its
   ``E`` from its own ``torch.Generator``, re-seeded at every step from (seed, output
   position), one value per vocabulary entry: its tokens depend neither on which other
   requests share the batch (nor on the path the batch takes), nor on where earlier
   tokens were computed -- a preempted request, or one that migrated to another worker
   with its output so far, draws exactly what an uninterrupted run would.

Fast paths (same results, less work): a batch of plain greedy rows (no penalties,
min_tokens or logprobs) is one ``argmax`` on the logits as they come (no float32 copy),
and a batch of plain unseeded rows sampling the whole vocabulary is one native draw on them
(:mod:`worker_svc.engine.cpu_sampling`, temperature and min-p included); on CPU every
inverse-CDF draw runs in that kernel. When every sampled row has a top-k of at most
:data:`TOP_K_FAST_MAX`, candidates come from ``topk`` instead of a full-vocabulary sort, and
so do a batch's top-p nuclei when they lie within the best :data:`TOP_K_FAST_MAX` tokens;
the draw runs over those candidates only (a seeded row still draws ``vocab`` values and
races its candidates with the values of their token ids, so both paths pick the same token).
On a GPU an unseeded row is drawn in one Triton kernel (:func:`triton_sampling.draw`),
its top-p nucleus included, and a seeded batch's nuclei are found on the device
(:func:`triton_sampling.nucleus_thresholds`): whether the candidates hold them is a
question only a synchronisation can answer, and nothing else in a step waits for the GPU.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from services.grammar import StructuredSpec
from worker_svc.engine import cpu_sampling, triton_sampling
from worker_svc.engine.host_copy import tensor_on, to_device
from worker_svc.engine.penalties import PenaltyTable
from worker_svc.engine.structured import apply_grammar_masks

__all__ = [
    "MAX_LOGPROBS",
    "Drawn",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingState",
    "TokenLogprob",
    "token_logprobs",
]

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20
# Largest top-k served by ``topk`` + a race over k candidates instead of a vocab-wide sort.
TOP_K_FAST_MAX = 1024
# A token under e**-PROB_FLOOR of its row's best is never drawn (_probs).
PROB_FLOOR = 80.0
# Candidate counts a top-p-only batch tries before the vocabulary-wide sort (_nucleus_candidates).
NUCLEUS_KS = (64, TOP_K_FAST_MAX)
# Below this temperature sampling is greedy (same threshold as vLLM).
_GREEDY_EPS = 1e-5

# (chosen token id, its logprob, [(top token id, logprob), ...] best first, rank of the
# chosen token: 1 + the number of tokens more likely than it)
TokenLogprob = tuple[int, float, list[tuple[int, float]], int]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI/vLLM names and semantics).

    ``top_k`` of -1 or 0 disables top-k. ``max_tokens`` counts generated tokens;
    ``min_tokens`` suppresses EOS/stop tokens until that many were generated.
    ``logprobs``/``prompt_logprobs`` ask for the N most likely alternatives per
    position (0 = only the chosen/prompt token).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # OpenAI logit_bias as (token id, bias) pairs; bias in [-100, 100].
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM: only these ids may be sampled (empty = any).
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM: words never generated (tokenized by the engine with the model's tokenizer).
    bad_words: tuple[str, ...] = ()
    # Structured outputs (grammar-constrained decoding); None = unconstrained.
    structured: StructuredSpec | None = None

    @property
    def token_rules(self) -> bool:
        """Whether the row needs the token-rules stage (bias, allow list, bad words, grammar)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.structured)

    @functools.cached_property
    def reads_output(self) -> bool:
        """Whether a draw reads the output's token values on the host: bad words, a grammar
        (penalties take a token still in flight from the device)."""
        return bool(self.bad_words) or self.structured is not None

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS

    @functools.cached_property
    def unedited(self) -> bool:
        """No penalties, token rules or logprobs: once min_tokens is reached, logits are
        sampled as they come (read for every row of every step, so computed once)."""
        return self.logprobs is None and not self.penalized and not self.token_rules

    @functools.cached_property
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty edits the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first offending field."""
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _check_int("top_k", self.top_k, lo=-1)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**64 - 1)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens)
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError("stop_token_ids must be a tuple of ints")
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids", tok, lo=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a bool")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, lo=0, hi=MAX_LOGPROBS)
        self._validate_token_rules()

    def _validate_token_rules(self) -> None:
        for tok, bias in self.logit_bias:
            _check_int("logit_bias", tok, lo=0)
            _check_float("logit_bias", bias, lo=-100.0, hi=100.0)
        for tok in self.allowed_token_ids:
            _check_int("allowed_token_ids", tok, lo=0)
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if self.structured is not None:
            self.structured.validate()

    def validate_vocab(self, vocab_size: int) -> None:
        """Token ids of the token rules must lie in the model's vocabulary."""
        for name, ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("allowed_token_ids", list(self.allowed_token_ids)),
        ):
            for tok in ids:
                if tok >= vocab_size:
                    raise ValueError(f"{name} token id {tok} is outside the vocabulary [0, {vocab_size})")


def _check_float(name: str, value: object, *, lo: float, hi: float = math.inf, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if v < lo or (lo_open and v == lo) or v > hi:
        bracket = "(" if lo_open else "["
        upper = "inf)" if hi == math.inf else f"{hi}]"
        raise ValueError(f"{name} must be in {bracket}{lo}, {upper}, got {value!r}")


def _check_int(name: str, value: object, *, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in [{lo}, {'inf' if hi is None else hi}], got {value!r}")


class SamplingState(Protocol):
    """What the sampler needs from a request (``Request`` satisfies it)."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def generator(self) -> torch.Generator | None: ...
    @property
    def in_flight(self) -> int: ...


class TokensInFlight(Protocol):
    """The tokens of the step still in flight, on the device, and the row in them of each
    request with a token there (async scheduling; ``model_runner.InFlight``)."""

    @property
    def tokens(self) -> torch.Tensor: ...
    @property
    def rows(self) -> Mapping[Any, int]: ...


@dataclass
class SamplerOutput:
    """One sampled token per row, plus logprobs for rows that asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class Drawn:
    """A batch's draw left on the device: its tokens and, for the rows that asked for
    logprobs (``lp_rows``, ``nums`` alternatives each), the chosen token's logprob and rank
    and the top alternatives. ``tensors`` are read back together; ``output`` makes the
    sampler's output of what was read."""

    tokens: torch.Tensor
    lp_rows: list[int] = field(default_factory=list)
    nums: list[int] = field(default_factory=list)
    logprob_parts: tuple[torch.Tensor, ...] = ()  # chosen logprobs, ranks[, top values, top ids]

    def tensors(self) -> list[torch.Tensor]:
        """What the host reads: the tokens, then the logprob parts."""
        return [self.tokens, *self.logprob_parts]

    def output(self, read: list[list[Any]]) -> SamplerOutput:
        """The sampler's output from ``tensors`` read back as lists, in their order."""
        tokens: list[int] = read[0]
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if self.lp_rows:
            chosen = [tokens[i] for i in self.lp_rows]
            for i, entry in zip(self.lp_rows, _logprob_entries(chosen, self.nums, *read[1:]), strict=True):
                logprobs[i] = entry
        return SamplerOutput(token_ids=tokens, logprobs=logprobs)


class Sampler:
    """Samples the next token for every row of a ``[num_rows, vocab]`` logits batch."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.penalties = PenaltyTable()

    def warm_up(self, device: torch.device, dtype: torch.dtype) -> None:
        """Builds the GPU's sampling kernels for logits of the model's ``dtype`` and float32
        (Triton compiles a kernel at its first call: seconds the first sampled request
        would wait otherwise); nothing where they do not serve. A kernel that fails to
        build leaves sampling to torch's ops, with a warning."""
        params = torch.tensor([[1.0], [PROB_FLOOR], [0.9]], device=device)  # scale, floor, top_p
        for kind in dict.fromkeys((dtype, torch.float32)):
            logits = torch.zeros(1, self.vocab_size, device=device, dtype=kind)
            if not triton_sampling.serves(logits):
                return
            try:
                triton_sampling.draw(logits, *params)
                if kind == torch.float32:
                    triton_sampling.nucleus_thresholds(logits, params[2])
            except Exception as exc:  # a compiler's failure: slower sampling, not a dead worker
                log.warning("the GPU's sampling kernels failed to build, sampling with torch ops: %r", exc)
                triton_sampling.fail(repr(exc))
                return

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingState]) -> SamplerOutput:
        """Sample one token per row; ``logits`` is not modified."""
        drawn = self.launch(logits, rows)
        return drawn.output([t.tolist() for t in drawn.tensors()])

    def launch(
        self, logits: torch.Tensor, rows: Sequence[SamplingState], in_flight: TokensInFlight | None = None
    ) -> Drawn:
        """The rows' draw, left on the logits' device (``Drawn``: read it back to use it).
        Rows count their tokens in flight as drawn (min_tokens, seeded positions), and a
        penalized row's token in flight is counted from ``in_flight``; rows with bad words
        or a grammar read their output's token values, which must all be here."""
        if logits.ndim != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        if self.penalties.held and not any(r.sampling_params.penalized for r in rows):
            self.penalties.release_all()
        if all(_plain_greedy(r) for r in rows):
            # Exact in any float dtype, first maximum wins (like argmax on float32); max(dim)
            # is the faster CPU kernel for bf16 logits.
            return Drawn(_first_argmax(logits))
        kernel = triton_sampling.serves(logits)  # the GPU's draw also takes top-p rows whole
        if all(_plain_random(r, kernel) for r in rows):
            params = [r.sampling_params for r in rows]
            scales, top_p = [1.0 / p.temperature for p in params], [p.top_p for p in params]
            nucleus = top_p if min(top_p) < 1.0 else None
            return Drawn(_draw_unseeded(logits, _floors(params), scales, top_p=nucleus))
        # Copy: the penalties below work in place and logits may be a view of model output.
        logits = logits.to(torch.float32, copy=True)
        lp_rows = [i for i, r in enumerate(rows) if r.sampling_params.logprobs is not None]
        lp_at = _index(lp_rows, logits) if lp_rows else None
        raw_logprobs = torch.log_softmax(logits[lp_at], dim=-1) if lp_at is not None else None
        pen = [i for i, r in enumerate(rows) if r.sampling_params.penalized]
        penalized = self.penalties.apply(logits, rows, pen, in_flight) if pen else None
        self._apply_min_tokens(logits, rows)
        if any(r.sampling_params.token_rules for r in rows):
            _apply_token_rules(logits, rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.sampling_params.greedy]
        if greedy:
            at = _index(greedy, logits)
            tokens[at] = _first_argmax(logits[at])
        rand = [i for i, r in enumerate(rows) if not r.sampling_params.greedy]
        if len(rand) == len(rows):  # no row copies in the common case
            tokens = self._sample_random(logits, rows)
        elif rand:
            at = _index(rand, logits)
            tokens[at] = self._sample_random(logits[at], [rows[i] for i in rand])
        if penalized is not None:
            self.penalties.count(penalized, tokens)
        if raw_logprobs is None or lp_at is None:
            return Drawn(tokens)
        nums = [rows[i].sampling_params.logprobs or 0 for i in lp_rows]
        parts = _logprob_parts(raw_logprobs, tokens[lp_at], max(nums))
        return Drawn(tokens, lp_rows, nums, parts)

    def _apply_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingState]) -> None:
        """EOS (unless ignored) and the stop tokens masked in rows short of min_tokens."""
        banned: list[tuple[int, int]] = []
        for i, row in enumerate(rows):
            p = row.sampling_params
            if _num_drawn(row) < p.min_tokens:
                eos = () if p.ignore_eos else self.eos_token_ids
                banned += [(i, t) for t in (*p.stop_token_ids, *eos) if t < self.vocab_size]
        _mask_pairs(logits, banned)

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SamplingState]) -> torch.Tensor:
        params = [r.sampling_params for r in rows]
        vocab = logits.shape[1]
        dev = logits.device
        temps = tensor_on([p.temperature for p in params], dev, logits.dtype)
        logits = logits.div_(temps.unsqueeze(1))  # in place: `sample` gave this call its own copy
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        candidates = None  # [rows, k] token ids when sampling among top-k candidates only
        if max(top_k) <= TOP_K_FAST_MAX:
            logits, candidates = _top_k_candidates(logits, top_k, top_p)
        elif min(top_k) >= vocab and min(top_p) < 1.0 and triton_sampling.serves(logits):
            if all(r.generator is None for r in rows):  # the nucleus and the draw in one kernel
                return _draw_unseeded(logits, _floors(params), top_p=top_p)
            thresholds = triton_sampling.nucleus_thresholds(logits, tensor_on(top_p, dev, logits.dtype))
            logits = logits.masked_fill_(logits < thresholds.unsqueeze(1), -math.inf)
        elif min(top_k) >= vocab and max(top_p) < 1.0 and (nucleus := _nucleus_candidates(logits, top_p)):
            logits, candidates = nucleus
        elif any(k < vocab for k in top_k) or any(tp < 1.0 for tp in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        chosen = _draw(logits, rows, candidates, vocab)
        if candidates is None:
            return chosen
        return candidates.gather(1, chosen.unsqueeze(1)).squeeze(1)


def _draw(
    logits: torch.Tensor, rows: Sequence[SamplingState], candidates: torch.Tensor | None, vocab: int
) -> torch.Tensor:
    """Column drawn per row from softmax(logits) (min-p applied): by inverse CDF for unseeded
    rows, by the exponential race for seeded ones.

    ``candidates`` maps the columns to token ids when ``logits`` holds top-k candidates
    only (``None``: the columns are the vocabulary)."""
    dev = logits.device
    floors = _floors([r.sampling_params for r in rows])
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        return _draw_unseeded(logits, floors)
    chosen = torch.empty(len(rows), dtype=torch.long, device=dev)
    if unseeded:
        at = _index(unseeded, logits)
        chosen[at] = _draw_unseeded(logits[at], [floors[j] for j in unseeded])
    seeded = [j for j, r in enumerate(rows) if r.generator is not None]
    seeded_at = _index(seeded, logits)
    probs = _probs(logits[seeded_at], tensor_on([floors[j] for j in seeded], dev, logits.dtype))
    race = torch.stack(
        [
            _seeded_draws(rows[j], vocab, probs.dtype, candidates[j] if candidates is not None else None)
            for j in seeded
        ]
    )
    chosen[seeded_at] = (probs / race).argmax(dim=-1)
    return chosen


def _floors(params: Sequence[SamplingParams]) -> list[float]:
    """How far below its row's best a logit may lie and still be drawn: ``PROB_FLOOR``, or
    less under min-p, which keeps p >= min_p * max p, i.e. logits within -log(min_p)."""
    return [min(PROB_FLOOR, -math.log(p.min_p)) if p.min_p > 0.0 else PROB_FLOOR for p in params]


def _draw_unseeded(
    logits: torch.Tensor,
    floors: list[float],
    scales: list[float] | None = None,
    top_p: list[float] | None = None,
) -> torch.Tensor:
    """Column per row by inverse CDF of softmax(logits * scales[row]), columns more than
    ``floors[row]`` below the row's best weighing 0 (and, with ``top_p``, columns outside
    the row's nucleus: on a GPU only): the native kernel on CPU (the same draw;
    docs/design-decisions.md, "The unseeded draw in a native kernel on CPU"), a Triton
    kernel on a GPU ("The unseeded draw in one kernel on a GPU"), else torch ops.
    ``scales`` None: the logits are already scaled."""
    n = logits.shape[0]
    native = cpu_sampling.load() if logits.device.type == "cpu" and top_p is None else None
    if native is not None and logits.dtype in native.dtypes and logits.stride(1) == 1:
        scale = torch.ones(n) if scales is None else torch.tensor(scales)
        return native(logits, scale, torch.tensor(floors), torch.rand(n))
    if triton_sampling.serves(logits) and logits.stride(1) == 1:
        params = [scales or [1.0] * n, floors, top_p or [1.0] * n]
        return triton_sampling.draw(logits, *tensor_on(params, logits.device, torch.float32))
    if top_p is not None:
        raise ValueError("a nucleus is drawn in the GPU's kernel only")
    if scales is not None:
        logits = logits.to(torch.float32) * tensor_on(scales, logits.device).unsqueeze(1)
    return _inverse_cdf(_probs(logits, tensor_on(floors, logits.device, logits.dtype)))


def _probs(
    logits: torch.Tensor, floors: torch.Tensor | None = None, exact_zeros: bool = True
) -> torch.Tensor:
    """``softmax`` per row, computed as if every logit more than ``floors[row]`` (default
    ``PROB_FLOOR``) below its row's largest were that far below: at a low temperature most
    of a row's logits are, and exp() of them yields float32 subnormals, which x86 computes
    slowly (docs/design-decisions.md, "Sampling without a full-vocabulary pass per row").
    Below ``PROB_FLOOR`` entries hold under
    vocab * e**-80 (~1e-30) of a row's mass; with ``exact_zeros`` they are 0, so that a masked
    (-inf) token stays impossible (and min-p's floor, ``-log(min_p)``, is exact)."""
    below = PROB_FLOOR if floors is None else floors.unsqueeze(1)
    floor = logits.amax(dim=-1, keepdim=True) - below
    probs = torch.softmax(torch.maximum(logits, floor), dim=-1)
    return probs.masked_fill_(logits < floor, 0.0) if exact_zeros else probs


def _inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """Column drawn per row from ``probs`` (rows need not sum to 1): one uniform per row
    against the row's running sum. Unseeded rows need only a correct draw, and the race's
    one exponential per column is the slow part of a CPU step (docs/design-decisions.md,
    "Sampling without a full-vocabulary pass per row"). Seeded rows keep the race: its
    draws depend on the seed and the position only, never on the batch."""
    cdf = probs.float().cumsum(dim=-1)
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def _seeded_draws(
    row: SamplingState, vocab: int, dtype: torch.dtype, token_ids: torch.Tensor | None
) -> torch.Tensor:
    """The row's ``E`` values for this step: one per vocabulary entry, from a generator
    seeded by (seed, output position) -- picked at ``token_ids`` in the candidate path."""
    generator = row.generator
    if generator is None:
        raise ValueError("an unseeded row has no seeded draws")
    generator.manual_seed(step_seed(row.sampling_params.seed or 0, _num_drawn(row)))
    draws = torch.empty(vocab, dtype=dtype, device=generator.device).exponential_(generator=generator)
    return draws if token_ids is None else draws[token_ids]


def step_seed(seed: int, position: int) -> int:
    """Seed of a seeded request's draw for output ``position`` (splitmix64 of both): every
    step is reproducible on its own, wherever and after whatever it runs."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK63


_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def _index(rows: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """``rows`` as an index tensor on ``like``'s device: indexing a GPU tensor with a Python
    list copies the list from pageable memory, which waits for the device's queued work."""
    return tensor_on(list(rows), like.device, torch.long)


def _first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum (``argmax`` semantics, via the faster ``max``)."""
    return logits.max(dim=-1).indices


def _num_drawn(row: SamplingState) -> int:
    """Tokens the row drew before this draw: its output and its tokens in flight (a step
    launched before theirs were read back: async scheduling)."""
    return len(row.output_token_ids) + row.in_flight


def _unedited(row: SamplingState) -> bool:
    """Whether the row's logits are sampled as they come: no penalties, pending min_tokens,
    token rules or logprobs (each of which needs a float32 copy)."""
    p = row.sampling_params
    return p.unedited and _num_drawn(row) >= p.min_tokens


def _plain_greedy(row: SamplingState) -> bool:
    """Greedy with nothing that needs float32 logits."""
    return row.sampling_params.greedy and _unedited(row)


def _plain_random(row: SamplingState, nucleus: bool = False) -> bool:
    """Unseeded sampling from the whole vocabulary (min-p at most; top-p too where the draw
    takes a ``nucleus``) with nothing that needs float32 logits: one draw from the logits
    as they come, temperature included."""
    p = row.sampling_params
    plain = p.top_p == 1.0 or nucleus
    return not p.greedy and p.top_k <= 0 and plain and row.generator is None and _unedited(row)


def _apply_token_rules(logits: torch.Tensor, rows: Sequence[SamplingState]) -> None:
    """logit_bias, allowed_token_ids, bad_words and grammar masks, in place, each rule one
    scatter over the rows that have it (a loop of per-row ops costs a GPU step a launch or
    more per row; the pairs go in one copy, and are filtered on the host: a boolean index
    would wait for the device)."""
    vocab, dev = logits.shape[1], logits.device
    bias: list[tuple[int, int]] = []
    amounts: list[float] = []
    allowed: list[tuple[int, int]] = []
    allowed_rows: list[int] = []
    banned: list[tuple[int, int]] = []
    constrained: list[int] = []
    for i, row in enumerate(rows):
        p = row.sampling_params
        bias += [(i, t) for t, _ in p.logit_bias]
        amounts += [b for _, b in p.logit_bias]
        if p.allowed_token_ids:
            allowed += [(len(allowed_rows), t) for t in p.allowed_token_ids if 0 <= t < vocab]
            allowed_rows.append(i)
        banned += [(i, t) for t in _bad_word_tokens(getattr(row, "bad_words_ids", ()), row.output_token_ids)]
        if getattr(row, "grammar", None) is not None:
            constrained.append(i)
    if bias:
        logits.index_put_(_pairs_on(bias, dev), tensor_on(amounts, dev, logits.dtype), accumulate=True)
    if allowed_rows:
        at = _index(allowed_rows, logits)
        outside = torch.ones(len(allowed_rows), vocab, dtype=torch.bool, device=dev)
        if allowed:
            outside.index_put_(_pairs_on(allowed, dev), torch.zeros((), dtype=torch.bool, device=dev))
        logits[at] = logits[at].masked_fill_(outside, -math.inf)
    _mask_pairs(logits, banned)
    if constrained:
        apply_grammar_masks(logits, constrained, [getattr(rows[i], "grammar", None) for i in constrained])


def _mask_pairs(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """-inf at each (row, token) of ``pairs``, in one scatter."""
    if pairs:
        minus_inf = torch.full((), -math.inf, dtype=logits.dtype, device=logits.device)
        logits.index_put_(_pairs_on(pairs, logits.device), minus_inf)


def _pairs_on(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) ``pairs`` as an index: their rows and their tokens, on ``device``."""
    rows, tokens = to_device({"pairs": pairs}, device)["pairs"].T
    return rows, tokens


def _bad_word_tokens(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """Last tokens of the bad-word sequences whose other tokens end ``output`` (vLLM's rule)."""
    banned = []
    for seq in sequences:
        prefix = list(seq[:-1])
        if not prefix or (len(output) >= len(prefix) and list(output[len(output) - len(prefix) :]) == prefix):
            banned.append(seq[-1])
    return banned


def _top_k_candidates(
    logits: torch.Tensor, top_k: list[int], top_p: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``max(top_k)`` best logits per row (best first, beyond each row's k and nucleus
    masked to -inf) and their token ids: top-k/top-p without sorting the vocabulary."""
    vals, ids = logits.topk(max(top_k), dim=-1)
    ranks = torch.arange(vals.shape[1], device=vals.device).unsqueeze(0)
    remove = ranks >= tensor_on(top_k, vals.device).unsqueeze(1)
    if any(tp < 1.0 for tp in top_p):
        remove |= _outside_nucleus(vals.masked_fill(remove, -math.inf), top_p)
    return vals.masked_fill(remove, -math.inf), ids


def _nucleus_candidates(logits: torch.Tensor, top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Top-p (no top-k) from the best logits per row, with the same mask as sorting the
    vocabulary, when every row's nucleus lies within them (their mass, against the whole
    row's, reaches top_p); else None. ``NUCLEUS_KS`` are tried in turn: a low temperature's
    nucleus is a few tokens, and ``topk`` costs about its k. The full sort was a quarter of
    a CPU decode step of a 49k-vocabulary model at top_p 0.9 and 32 rows.

    The probabilities come from :func:`_probs`, not ``exp`` of ``logits - logsumexp``."""
    probs_all = _probs(logits, exact_zeros=False)  # masses only: no token is drawn from it
    limit = tensor_on(top_p, probs_all.device, probs_all.dtype).unsqueeze(1)
    for k in NUCLEUS_KS:
        vals, ids = logits.topk(min(k, logits.shape[1]), dim=-1)
        probs = probs_all.gather(1, ids)
        if bool((probs.sum(dim=-1, keepdim=True) >= limit).all()):
            remove = probs.cumsum(dim=-1) - probs >= limit
            return vals.masked_fill(remove, -math.inf), ids
    return None


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k and nucleus (smallest set with mass >= top_p)."""
    vocab = logits.shape[1]
    dev = logits.device
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    remove = ranks >= tensor_on(top_k, dev).unsqueeze(1)
    if any(tp < 1.0 for tp in top_p):
        remove |= _outside_nucleus(sorted_logits.masked_fill(remove, -math.inf), top_p)
    mask = torch.zeros_like(remove).scatter_(1, sorted_idx, remove)
    return logits.masked_fill(mask, -math.inf)


def _outside_nucleus(sorted_logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Mask of sorted (best-first) entries past each row's nucleus: mass before them >= top_p."""
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 get a threshold above any mass so float rounding never trims them.
    limit = tensor_on([tp if tp < 1.0 else 2.0 for tp in top_p], probs.device, probs.dtype)
    return mass_before >= limit.unsqueeze(1)


def token_logprobs(
    logprobs: torch.Tensor, chosen: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """Per row: (chosen id, its logprob, top-``num_top`` alternatives, rank of the chosen id)
    from a ``[n, V]`` logprob matrix."""
    if not chosen:
        return []
    idx = tensor_on(list(chosen), logprobs.device, torch.long)
    parts = _logprob_parts(logprobs, idx, max(num_top))
    return _logprob_entries(chosen, num_top, *(t.tolist() for t in parts))


def _logprob_parts(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """On the logprobs' device: each row's chosen-token logprob and rank (1 + the tokens more
    likely than it), then with ``k`` its top-k logprobs and their token ids."""
    chosen_t = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_t).sum(dim=1) + 1
    if k <= 0:
        return chosen_t.squeeze(1), ranks
    vals, ids = logprobs.topk(k, dim=-1)
    return chosen_t.squeeze(1), ranks, vals, ids


def _logprob_entries(
    chosen: Sequence[int],
    num_top: Sequence[int],
    chosen_lp: list[float],
    ranks: list[int],
    top_vals: list[list[float]] | None = None,
    top_ids: list[list[int]] | None = None,
) -> list[TokenLogprob]:
    """``TokenLogprob`` entries from `_logprob_parts` read back as lists."""
    return [
        (
            tok,
            lp,
            list(zip(top_ids[r][: num_top[r]], top_vals[r][: num_top[r]], strict=True))
            if top_ids is not None and top_vals is not None
            else [],
            ranks[r],
        )
        for r, (tok, lp) in enumerate(zip(chosen, chosen_lp, strict=True))
    ]
