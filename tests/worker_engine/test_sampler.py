"""Sampler unit tests on synthetic logits (no model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from worker_svc.engine.sampling import TOP_K_FAST_MAX, Sampler, SamplingParams

V = 32
EOS = 2


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    in_flight: int = 0


def seeded(params: SamplingParams) -> Row:
    gen = None
    if params.seed is not None:
        gen = torch.Generator().manual_seed(params.seed)
    return Row(params, generator=gen)


def logits_batch(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_input_untouched() -> None:
    logits = logits_batch(3)
    before = logits.clone()
    out = Sampler(V, [EOS]).sample(logits, [Row(SamplingParams(temperature=0))] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)
    assert out.logprobs == [None, None, None]


def test_top_k_one_top_p_tiny_min_p_one_are_greedy() -> None:
    logits = logits_batch(4, seed=1)
    rows = [
        Row(SamplingParams(top_k=1)),
        Row(SamplingParams(top_p=1e-6)),
        Row(SamplingParams(min_p=1.0)),
        Row(SamplingParams(top_k=1, top_p=0.5, temperature=5.0)),
    ]
    sampler = Sampler(V, [EOS])
    for _ in range(5):
        assert sampler.sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_restricts_support() -> None:
    logits = logits_batch(1, seed=2)
    allowed = set(logits[0].topk(3).indices.tolist())
    rows = [Row(SamplingParams(top_k=3, temperature=10.0))] * 64
    out = Sampler(V, [EOS]).sample(logits.expand(64, V), rows)
    assert set(out.token_ids) <= allowed
    assert len(set(out.token_ids)) > 1


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4)])
    logits = torch.log(probs.clamp_min(1e-12))
    rows = [Row(SamplingParams(top_p=0.75))] * 200
    out = Sampler(V, [EOS]).sample(logits.expand(200, V), rows)
    assert set(out.token_ids) == {0, 1}  # 0.5 < 0.75 <= 0.8


def test_min_p_filters_relative_to_max() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.1] + [0.0] * (V - 3)])
    logits = torch.log(probs.clamp_min(1e-12))
    rows = [Row(SamplingParams(min_p=0.4))] * 200  # threshold 0.24: keeps tokens 0, 1
    out = Sampler(V, [EOS]).sample(logits.expand(200, V), rows)
    assert set(out.token_ids) == {0, 1}


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    logits[0, 6] = 1.9
    logits[0, 7] = -1.0
    sampler = Sampler(V, [EOS])
    row = Row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_token_ids=[5])
    assert sampler.sample(logits, [row]).token_ids == [6]  # 2.0 / 2 = 1.0 < 1.9
    # Negative logits get multiplied: the seen token 7 becomes even less likely.
    logits2 = torch.full((1, V), -5.0)
    logits2[0, 7] = -1.0
    logits2[0, 8] = -1.5
    row2 = Row(SamplingParams(temperature=0, repetition_penalty=2.0), output_token_ids=[7])
    assert sampler.sample(logits2, [row2]).token_ids == [8]


def test_presence_and_frequency_penalty_use_output_only() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.5
    sampler = Sampler(V, [EOS])
    in_prompt = Row(SamplingParams(temperature=0, presence_penalty=1.0), prompt_token_ids=[5])
    assert sampler.sample(logits, [in_prompt]).token_ids == [5]
    in_output = Row(SamplingParams(temperature=0, presence_penalty=1.0), output_token_ids=[5])
    assert sampler.sample(logits, [in_output]).token_ids == [6]
    freq = Row(SamplingParams(temperature=0, frequency_penalty=0.3), output_token_ids=[5, 5])
    assert sampler.sample(logits, [freq]).token_ids == [6]  # 1.0 - 2 * 0.3 = 0.4 < 0.5
    freq1 = Row(SamplingParams(temperature=0, frequency_penalty=0.3), output_token_ids=[5])
    assert sampler.sample(logits, [freq1]).token_ids == [5]  # 1.0 - 0.3 = 0.7 > 0.5


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 4] = 8.0
    sampler = Sampler(V, [EOS])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(9,))
    assert sampler.sample(logits, [Row(p, output_token_ids=[1])]).token_ids == [4]
    assert sampler.sample(logits, [Row(p, output_token_ids=[1, 1])]).token_ids == [EOS]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler.sample(logits, [Row(ignore)]).token_ids == [EOS]


def test_seed_reproducible_regardless_of_batch() -> None:
    sampler = Sampler(V, [EOS])
    base = logits_batch(1, seed=3)
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw(batch: int, pos: int, steps: int = 20) -> list[int]:
        row = seeded(params)
        others = [Row(SamplingParams(temperature=0.7)) for _ in range(batch - 1)]
        rows = [*others[:pos], row, *others[pos:]]
        logits = torch.cat([logits_batch(batch, seed=9)[:pos], base, logits_batch(batch, seed=9)[pos:]])[
            :batch
        ]
        logits[pos] = base[0]
        for _ in range(steps):
            row.output_token_ids.append(sampler.sample(logits, rows).token_ids[pos])
        return row.output_token_ids

    alone = draw(1, 0)
    assert draw(5, 2) == alone
    assert draw(8, 7) == alone
    assert len(set(alone)) > 1  # it really samples
    other_seed = seeded(SamplingParams(temperature=1.0, seed=99))
    for _ in range(20):
        other_seed.output_token_ids.append(sampler.sample(base, [other_seed]).token_ids[0])
    assert other_seed.output_token_ids != alone


def _seeded_run(sampler: Sampler, logits: torch.Tensor, row: Row, steps: int, others: list[Row]) -> list[int]:
    rest = torch.randn(len(others), logits.shape[1], generator=torch.Generator().manual_seed(5))
    for _ in range(steps):
        batch = torch.cat([logits, rest])
        row.output_token_ids.append(sampler.sample(batch, [row, *others]).token_ids[0])
    return row.output_token_ids


def test_seeded_top_k_same_on_fast_and_full_path() -> None:
    # Alone, a top-k=4 row takes the top-k fast path; next to a row without top-k the
    # batch takes the full-vocabulary path: the seeded row must draw the same tokens.
    vocab = 2 * TOP_K_FAST_MAX  # the full path needs a vocabulary above the fast path's limit
    sampler = Sampler(vocab, [EOS])
    base = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.0, top_k=4, seed=7)
    fast = _seeded_run(sampler, base, seeded(params), 24, [])
    other = Row(SamplingParams(temperature=1.0))
    full = _seeded_run(sampler, base, seeded(params), 24, [other])
    assert len(set(fast)) > 1
    assert full == fast


def test_seeded_draw_resumes_at_its_position() -> None:
    # A request that continues elsewhere with its first 10 tokens (preemption, migration)
    # draws what the uninterrupted run drew next, even on a fresh generator.
    sampler = Sampler(V, [EOS])
    base = logits_batch(1, seed=6)
    params = SamplingParams(temperature=1.0, seed=11)
    whole = _seeded_run(sampler, base, seeded(params), 20, [])
    resumed = Row(params, output_token_ids=list(whole[:10]), generator=torch.Generator().manual_seed(123))
    assert _seeded_run(sampler, base, resumed, 10, []) == whole


def test_sampling_matches_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1] + [0.0] * (V - 3))
    logits = torch.log(probs.clamp_min(1e-12)).expand(4000, V)
    gen_row = seeded(SamplingParams(seed=0))
    rows = [gen_row] + [Row(SamplingParams()) for _ in range(3999)]
    torch.manual_seed(0)
    out = Sampler(V, [EOS]).sample(logits, rows).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=V).float() / len(out)
    assert torch.allclose(freq[:3], probs[:3], atol=0.03)


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = logits_batch(2, seed=4)
    rows = [
        Row(SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5), prompt_token_ids=[0]),
        Row(SamplingParams(temperature=0)),
    ]
    out = Sampler(V, [EOS]).sample(logits, rows)
    assert out.logprobs[1] is None
    entry = out.logprobs[0]
    assert entry is not None
    tok, lp, top, rank = entry
    raw = torch.log_softmax(logits[0], -1)
    assert tok == out.token_ids[0]
    assert rank == int((raw > raw[tok]).sum()) + 1
    assert math.isclose(lp, raw[tok].item(), rel_tol=1e-5)
    assert [t for t, _ in top] == raw.topk(3).indices.tolist()
    assert all(math.isclose(v, raw[t].item(), rel_tol=1e-5) for t, v in top)
    zero = Sampler(V, [EOS]).sample(logits[:1], [Row(SamplingParams(temperature=0, logprobs=0))])
    assert zero.logprobs[0] is not None and zero.logprobs[0][2] == []


def _boom(*args: object, **kwargs: object) -> None:
    raise AssertionError("slow path taken")


def test_plain_greedy_fast_path_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 logits, greedy rows with nothing else: argmax on the logits as they are."""
    logits = logits_batch(5, seed=7).to(torch.bfloat16)
    expected = logits.float().argmax(-1).tolist()
    monkeypatch.setattr(Sampler, "_apply_min_tokens", _boom)  # a step of the general path
    out = Sampler(V, [EOS]).sample(logits, [Row(SamplingParams(temperature=0))] * 5)
    assert out.token_ids == expected and out.logprobs == [None] * 5


def test_greedy_with_penalty_still_takes_the_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = logits_batch(2, seed=8)
    calls: list[list[int]] = []
    sampler = Sampler(V, [EOS])
    original = sampler.penalties.apply

    def spy(lg: torch.Tensor, rows: list[Row], pen: list[int], in_flight: object) -> object:
        calls.append(pen)
        return original(lg, rows, pen, in_flight)

    monkeypatch.setattr(sampler.penalties, "apply", spy)
    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams(temperature=0, repetition_penalty=1.5))]
    sampler.sample(logits, rows)
    assert calls == [[1]]


def test_top_k_fast_path_uses_no_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = logits_batch(3, seed=9)
    allowed = [set(row.topk(4).indices.tolist()) for row in logits]
    monkeypatch.setattr(torch.Tensor, "sort", _boom)
    rows = [
        Row(SamplingParams(top_k=4, temperature=5.0)),
        Row(SamplingParams(top_k=1)),
        seeded(SamplingParams(top_k=4, seed=3)),
    ]
    sampler = Sampler(V, [EOS])
    for _ in range(30):
        toks = sampler.sample(logits, rows).token_ids
        assert toks[0] in allowed[0] and toks[2] in allowed[2]
        assert toks[1] == logits[1].argmax().item()


def test_top_k_top_p_candidates_equal_the_sorted_mask() -> None:
    """The topk-based mask keeps exactly the tokens the vocab-sort mask keeps."""
    from worker_svc.engine.sampling import _top_k_candidates, _top_k_top_p

    logits = logits_batch(4, seed=10)
    top_k, top_p = [5, 10, 3, 8], [0.5, 1.0, 0.9, 0.3]
    vals, ids = _top_k_candidates(logits, top_k, top_p)
    full = _top_k_top_p(logits, top_k, top_p)
    for r in range(4):
        kept_fast = {int(t) for t, v in zip(ids[r], vals[r], strict=True) if v > -math.inf}
        kept_full = set(torch.nonzero(full[r] > -math.inf).flatten().tolist())
        assert kept_fast == kept_full, f"row {r}"


def test_top_k_fast_path_seeded_is_reproducible() -> None:
    logits = logits_batch(1, seed=11)
    params = SamplingParams(top_k=6, temperature=2.0, seed=42)
    first = [Sampler(V, [EOS]).sample(logits, [seeded(params)]).token_ids[0] for _ in range(3)]
    again = _seeded_run(Sampler(V, [EOS]), logits, seeded(params), 8, [])
    assert first == [again[0]] * 3 and len(set(again)) > 1


def test_greedy_ties_pick_the_first_maximum() -> None:
    """Like argmax (and transformers' greedy search): the lowest index among equal maxima."""
    logits = torch.zeros(3, V)
    logits[:, [7, 3, 20]] = 5.0
    sampler = Sampler(V, [EOS])
    for dtype in (torch.float32, torch.bfloat16):
        fast = sampler.sample(logits.to(dtype), [Row(SamplingParams(temperature=0))] * 3)
        full = sampler.sample(
            logits.to(dtype), [Row(SamplingParams(temperature=0, repetition_penalty=1.01))] * 3
        )
        assert fast.token_ids == [3, 3, 3] and full.token_ids == [3, 3, 3]


def test_unseeded_rows_draw_one_uniform_per_row_not_one_exponential_per_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exponential per vocabulary entry was the slow part of a CPU step; unseeded rows draw by
    inverse CDF, with the distribution and the support (min_p, top_p) unchanged."""
    monkeypatch.setattr(torch.Tensor, "exponential_", _boom)
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05] + [0.0] * (V - 4))
    logits = torch.log(probs.clamp_min(1e-12)).expand(4000, V)
    torch.manual_seed(1)
    out = Sampler(V, [EOS]).sample(logits, [Row(SamplingParams())] * 4000).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=V).float() / len(out)
    assert torch.allclose(freq[:4], probs[:4], atol=0.03) and freq[4:].sum() == 0
    kept = Sampler(V, [EOS]).sample(logits[:400], [Row(SamplingParams(min_p=0.3))] * 400).token_ids
    assert set(kept) == {0, 1}  # threshold 0.18


def test_top_p_nucleus_without_a_vocabulary_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-p alone over a vocabulary larger than TOP_K_FAST_MAX: the nucleus is taken from the
    best candidates, with exactly the sorted path's mask, when it lies within them; a flat row
    whose nucleus does not falls back to the sort."""
    from worker_svc.engine.sampling import TOP_K_FAST_MAX, _nucleus_candidates, _top_k_top_p

    vocab = 4 * TOP_K_FAST_MAX
    peaked = torch.randn(3, vocab, generator=torch.Generator().manual_seed(11)) * 4.0
    top_p = [0.9, 0.5, 0.99]
    found = _nucleus_candidates(peaked, top_p)
    assert found is not None
    vals, ids = found
    full = _top_k_top_p(peaked, [vocab] * 3, top_p)
    for r in range(3):
        kept_fast = {int(t) for t, v in zip(ids[r], vals[r], strict=True) if v > -math.inf}
        assert kept_fast == set(torch.nonzero(full[r] > -math.inf).flatten().tolist()), f"row {r}"
    assert _nucleus_candidates(torch.zeros(1, vocab), [0.9]) is None, "a flat row's nucleus is wider"
    # A low temperature's nucleus is found among the fewest candidates; a wide one among more.
    assert _nucleus_candidates(peaked[:1] * 10, [0.9])[1].shape[1] == 64  # type: ignore[index]
    assert _nucleus_candidates(peaked[2:], [0.99])[1].shape[1] == TOP_K_FAST_MAX  # type: ignore[index]
    monkeypatch.setattr(torch.Tensor, "sort", _boom)
    rows = [Row(SamplingParams(top_p=p)) for p in top_p]
    for _ in range(20):
        toks = Sampler(vocab, [EOS]).sample(peaked, rows).token_ids
        assert all(full[r, t] > -math.inf for r, t in enumerate(toks))


def test_probabilities_under_the_floor_are_zero_and_masked_tokens_stay_impossible() -> None:
    """The sampler's softmax drops what lies more than PROB_FLOOR below a row's best (exp() of it
    would be a float32 subnormal: slow on x86, and ~1e-44 of the mass); the rest equals softmax,
    and a masked (-inf) token keeps probability 0."""
    from worker_svc.engine.sampling import PROB_FLOOR, _probs

    logits = torch.tensor([[0.0, -10.0, -(PROB_FLOOR + 20.0), -math.inf, 2.0]])
    probs = _probs(logits)
    exact = torch.softmax(logits, dim=-1)
    assert exact[0, 2] > 0 and probs[0, 2] == 0 and probs[0, 3] == 0
    assert torch.allclose(probs, exact, rtol=1e-6, atol=1e-30)
    assert abs(float(_probs(logits, exact_zeros=False).sum()) - 1.0) < 1e-6
    rows = [Row(SamplingParams(temperature=0.01))] * 200
    toks = Sampler(5, [EOS]).sample(logits.expand(200, 5), rows).token_ids
    assert set(toks) == {4}  # at T=0.01 every other token is > PROB_FLOOR below the best
