"""The GPU sampler's top-p nucleus found on the device (triton_sampling) against the
sorted nucleus in float64, and the sampler's top-p path through it.

Natively on a GPU; on CPU only under TRITON_INTERPRET=1 (test_triton_interpret runs this
file in a child pytest with it set)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.worker_engine.test_sampler import EOS, Row, _boom
from worker_svc.engine import sampling, triton_attention, triton_sampling
from worker_svc.engine.sampling import TOP_K_FAST_MAX, Sampler, SamplingParams

pytestmark = pytest.mark.skipif(
    not triton_attention.HAS_TRITON or not (torch.cuda.is_available() or triton_attention.interpreting()),
    reason="needs triton with CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sorted_threshold(row: torch.Tensor, top_p: float) -> float:
    """The smallest logit the sorted nucleus keeps (tokens whose mass before them, best
    first, is under top_p), in float64; checks the row's boundary is not a rounding call."""
    if top_p >= 1.0:
        return -math.inf
    probs = torch.softmax(row.double(), dim=-1)
    ordered, order = row.double().sort(descending=True)
    cum = probs[order].cumsum(0)
    last = int((cum < top_p).sum())  # the first token whose running mass reaches top_p
    assert abs(float(cum[last]) - top_p) > 1e-5, "the case sits on float32's rounding"
    return float(ordered[last])


def _rows(vocab: int, seed: int) -> torch.Tensor:
    """Rows from nearly one-hot to nearly flat; one with masked (-inf) tokens, one in bf16's
    precision (many ties), one whose masked tokens fill whole tiles."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.05, 0.5, 1.0, 2.0, 4.0, 12.0, 1.0, 3.0])
    logits = torch.randn(len(scales), vocab, generator=gen) * scales.unsqueeze(1)
    logits[1, ::3] = -math.inf
    logits[6] = logits[6].bfloat16().float()
    logits[7, : vocab - 40] = -math.inf
    return logits


# Seeds whose boundaries all lie clear of float32 rounding (_sorted_threshold checks it).
@pytest.mark.parametrize(("vocab", "seed"), [(700, 0), (4099, 1)])
def test_thresholds_equal_the_sorted_nucleus(vocab: int, seed: int) -> None:
    logits = _rows(vocab, seed)
    top_p = [0.9, 0.5, 0.95, 0.99, 0.3, 0.8, 0.9, 0.7]
    found = triton_sampling.nucleus_thresholds(logits.to(DEVICE), torch.tensor(top_p, device=DEVICE)).tolist()
    assert found == [_sorted_threshold(row, p) for row, p in zip(logits, top_p, strict=True)]


def test_ties_at_the_boundary_are_kept_and_top_p_one_keeps_all() -> None:
    """Four tokens share the boundary's logit: all stay (the sort would keep those its order
    put first); a row with top_p 1 keeps every token; a top_p under the best token's mass
    (0.65) keeps it alone."""
    row = torch.tensor([3.0, 1.0, 1.0, 1.0, 1.0, -2.0, -5.0, -math.inf])
    logits = torch.stack([row, row, row]).to(DEVICE)
    found = triton_sampling.nucleus_thresholds(logits, torch.tensor([0.7, 1.0, 0.6], device=DEVICE))
    assert found.tolist() == [1.0, -math.inf, 3.0]


NARROW_FAST_MAX = 64  # the top-k fast path's limit in the tests that need a vocabulary past it


@pytest.fixture
def narrow_fast_path(monkeypatch: pytest.MonkeyPatch) -> int:
    """A vocabulary wider than the top-k fast path's limit, made small: the limit is lowered
    to NARROW_FAST_MAX (the interpreter's time grows with the row), the vocabulary is 5 wider."""
    monkeypatch.setattr(sampling, "TOP_K_FAST_MAX", NARROW_FAST_MAX)
    return NARROW_FAST_MAX + 5


def test_a_top_p_batch_is_drawn_from_its_nucleus_without_the_host(
    monkeypatch: pytest.MonkeyPatch, narrow_fast_path: int
) -> None:
    """Top-p rows over a vocabulary wider than TOP_K_FAST_MAX take the device's nucleus:
    no candidate check (which reads a flag back) and no sort; seeded and top_p=1 rows in the
    same batch. Every draw lies in its row's nucleus, and the draws follow it."""
    vocab = narrow_fast_path
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=gen) * torch.tensor([[6.0], [6.0], [6.0], [0.1]])
    logits = logits.to(DEVICE)
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.6, temperature=0.7),
        SamplingParams(top_p=0.8, seed=5),
        SamplingParams(top_p=1.0),
    ]
    rows = [Row(p, generator=torch.Generator(DEVICE).manual_seed(5) if p.seed else None) for p in params]
    nucleus = []
    for r, p in enumerate(params):
        scaled = logits[r].cpu() / torch.tensor(p.temperature)  # as the sampler divides
        kept = scaled >= _sorted_threshold(scaled, p.top_p)
        nucleus.append(set(torch.nonzero(kept).flatten().tolist()))
    monkeypatch.setattr(sampling, "_nucleus_candidates", _boom)
    monkeypatch.setattr(torch.Tensor, "sort", _boom)
    sampler = Sampler(vocab, [EOS])
    torch.manual_seed(0)
    draws = [sampler.sample(logits, rows).token_ids for _ in range(100)]
    for r in range(3):
        assert {d[r] for d in draws} <= nucleus[r], f"row {r} drew outside its nucleus"
    assert len({d[3] for d in draws}) > vocab // 2, "top_p=1 keeps the whole vocabulary"
    # Row 0's most likely token, renormalised to its nucleus, at its frequency.
    probs = torch.softmax(logits[0].cpu().double(), dim=-1)
    mass = float(probs[sorted(nucleus[0])].sum())
    best = int(logits[0].argmax())
    assert abs(sum(d[0] == best for d in draws) / len(draws) - float(probs[best]) / mass) < 0.12


def _recording(calls: list[tuple[str, torch.dtype]], name: str, real: Any) -> Any:
    """``real``, recording (name, logits dtype) of each call in ``calls``."""

    def called(logits: torch.Tensor, *args: Any) -> Any:
        calls.append((name, logits.dtype))
        return real(logits, *args)

    return called


def _reference_draw(row: torch.Tensor, scale: float, floor: float, top_p: float, u: float) -> int:
    """The inverse-CDF draw in float64: the first token whose running mass (tokens within
    ``floor`` of the best and in the nucleus) passes ``u`` of the kept mass."""
    x = row.double() * scale
    lowest = max(float(x.max()) - floor, _sorted_threshold(x, top_p) if top_p < 1.0 else -math.inf)
    weight = torch.where(x >= lowest, torch.exp(x - x.max()), 0.0)
    running = weight.cumsum(0)
    target = u * float(running[-1])
    token = int((running <= target).sum())
    assert abs(float(running[token]) - target) > 1e-5 * float(running[-1]), "on float32's rounding"
    return token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_draw_kernel_equals_the_inverse_cdf_in_float64(dtype: torch.dtype) -> None:
    """Plain rows, min-p's floor, top-p at a temperature, masked tokens: the kernel's token
    is the float64 draw's for the same uniforms (torch's generator, one per row)."""
    logits = _rows(1500, seed=5).to(dtype)
    cases = [(1.0, 80.0, 1.0), (1.0, 2.3, 1.0), (1 / 0.7, 80.0, 0.9), (1.0, 80.0, 0.5)] * 2
    scales, floors, top_p = (torch.tensor(c, device=DEVICE) for c in zip(*cases, strict=True))
    torch.manual_seed(7)
    got = triton_sampling.draw(logits.to(DEVICE), scales, floors, top_p).tolist()
    torch.manual_seed(7)
    u = torch.rand(len(cases), device=DEVICE).tolist()
    rows = logits.float()
    assert got == [_reference_draw(rows[i], *cases[i], u[i]) for i in range(len(cases))]


def test_an_unseeded_top_p_batch_is_drawn_in_one_kernel(
    monkeypatch: pytest.MonkeyPatch, narrow_fast_path: int
) -> None:
    """Unseeded top-p rows (a temperature, min-p on one) draw nucleus and token in the draw
    kernel, from the model's bf16 logits as they come: no float32 copy, no threshold pass
    of their own, no candidates, no sort."""
    vocab = narrow_fast_path
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4)) * torch.tensor([[1.5], [1.0]])
    logits = logits.to(DEVICE, torch.bfloat16)
    params = [SamplingParams(top_p=0.7, temperature=0.8), SamplingParams(top_p=0.95, min_p=0.05)]
    nuclei = []
    for r, p in enumerate(params):
        scaled = logits[r].float().cpu() * (1.0 / p.temperature)  # as the kernel scales
        floor = float(scaled.max()) + math.log(p.min_p) if p.min_p else -math.inf
        kept = scaled >= max(_sorted_threshold(scaled, p.top_p), floor)
        nuclei.append(set(torch.nonzero(kept).flatten().tolist()))
        assert len(nuclei[-1]) > 4, f"row {r}: a nucleus of a few tokens shows little"
    calls: list[tuple[str, torch.dtype]] = []
    monkeypatch.setattr(triton_sampling, "draw", _recording(calls, "draw", triton_sampling.draw))
    monkeypatch.setattr(triton_sampling, "nucleus_thresholds", _boom)
    monkeypatch.setattr(sampling, "_nucleus_candidates", _boom)
    monkeypatch.setattr(torch.Tensor, "sort", _boom)
    torch.manual_seed(0)
    draws = [Sampler(vocab, [EOS]).sample(logits, [Row(p) for p in params]).token_ids for _ in range(40)]
    assert calls == [("draw", torch.bfloat16)] * 40
    for r, nucleus in enumerate(nuclei):
        assert {d[r] for d in draws} <= nucleus, f"row {r} drew outside its nucleus"
        assert len({d[r] for d in draws}) > 1, f"row {r} drew one token only"


def test_warm_up_builds_each_kernel_a_draw_may_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draw for the model's dtype and float32 logits, and the nucleus search, before the
    first sampled request (Triton compiles a kernel at its first call)."""
    calls: list[tuple[str, torch.dtype]] = []
    for name in ("draw", "nucleus_thresholds"):
        monkeypatch.setattr(triton_sampling, name, _recording(calls, name, getattr(triton_sampling, name)))
    Sampler(64, [EOS]).warm_up(torch.device(DEVICE), torch.bfloat16)
    assert calls == [("draw", torch.bfloat16), ("draw", torch.float32), ("nucleus_thresholds", torch.float32)]


def test_a_kernel_that_fails_to_build_leaves_sampling_to_torch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Triton build failure at warm-up is a warning and torch's ops sample from then on,
    never a worker that does not start."""
    monkeypatch.setattr(triton_sampling, "failed", None)
    monkeypatch.setattr(triton_sampling, "draw", _boom)
    sampler = Sampler(TOP_K_FAST_MAX + 5, [EOS])
    sampler.warm_up(torch.device(DEVICE), torch.float32)
    assert "failed to build" in caplog.text and triton_sampling.failed is not None
    logits = torch.randn(2, TOP_K_FAST_MAX + 5).to(DEVICE)
    assert not triton_sampling.serves(logits)
    tokens = sampler.sample(logits, [Row(SamplingParams(top_p=0.9)), Row(SamplingParams())]).token_ids
    assert all(0 <= t < TOP_K_FAST_MAX + 5 for t in tokens)
