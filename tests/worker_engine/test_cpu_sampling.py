"""The native CPU row sampler (csrc/sample_rows.c) against the torch definition of the draw."""

from __future__ import annotations

import math

import pytest
import torch

from tests.worker_engine.test_sampler import Row
from worker_svc.engine import cpu_sampling, sampling
from worker_svc.engine.sampling import PROB_FLOOR, Sampler, SamplingParams

KERNEL = cpu_sampling.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="native CPU kernels unavailable (no C compiler?)")


def _weights(x: torch.Tensor, scale: float, floor: float) -> torch.Tensor:
    """The draw's definition in float64: exp(scale * x - max), 0 below max - floor."""
    s = x.double() * scale
    w = torch.exp(s - s.max())
    return w.masked_fill(s < s.max() - floor, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_column_is_drawn_exactly_where_its_cdf_interval_lies(dtype: torch.dtype) -> None:
    """u at the middle of column i's CDF interval draws i: the draw is the inverse CDF, through
    the block sums and across block boundaries (300 columns, blocks of 64)."""
    assert KERNEL is not None
    x = (torch.randn(300, generator=torch.Generator().manual_seed(3)) * 2.0).to(dtype)
    x[17] = -math.inf  # a masked token
    x[[0, 63, 64, 128, 299]] = torch.tensor([3.0, 2.5, 3.5, 2.0, 3.0], dtype=dtype)  # block edges weigh
    scale, floor = 1.0 / 0.7, 6.0  # temperature 0.7, a floor that zeroes part of the row
    w = _weights(x, scale, floor)
    assert 0 < int((w == 0).sum()) < 299, "the floor must zero some columns, not all"
    cdf = w.cumsum(0)
    drawn_cols = [int(i) for i in torch.nonzero(w > 0).flatten()]
    mids = [float((cdf[i] - w[i] / 2) / cdf[-1]) for i in drawn_cols]
    logits = x.unsqueeze(0).expand(len(mids), 300)  # row stride 0: every row reads x
    n = len(mids)
    got = KERNEL(logits, torch.full((n,), scale), torch.full((n,), floor), torch.tensor(mids))
    assert got.tolist() == drawn_cols


def test_extremes_of_u_never_draw_a_zero_weight_column() -> None:
    assert KERNEL is not None
    x = torch.full((2, 130), -math.inf)
    x[0, 70] = 1.0
    x[1, 5], x[1, 129] = 0.0, -(PROB_FLOOR + 1.0)  # 129 lies under the floor
    ones, floors = torch.ones(2), torch.full((2,), PROB_FLOOR)
    for u in (0.0, 0.5, 1.0 - 2**-24):
        assert KERNEL(x, ones, floors, torch.full((2,), u)).tolist() == [70, 5]


def test_a_row_without_weight_gets_its_first_largest_column() -> None:
    assert KERNEL is not None
    x = torch.full((2, 10), -math.inf)
    x[1, 3] = math.inf
    assert KERNEL(x, torch.ones(2), torch.full((2,), PROB_FLOOR), torch.full((2,), 0.5)).tolist() == [0, 3]


def test_native_and_torch_draws_have_the_same_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Temperature and min-p through the plain fast path (native) and through torch ops."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * 60)
    logits = torch.log(probs.clamp_min(1e-30)).to(torch.bfloat16).expand(6000, 64)
    params = SamplingParams(temperature=2.0, min_p=0.4)  # T=2: p ~ sqrt(probs); keeps >= 0.4 * max
    kept = probs.sqrt() * (probs.sqrt() >= 0.4 * probs.sqrt().max())
    expected = kept[:4] / kept.sum()
    rows = [Row(params)] * 6000
    freqs = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(cpu_sampling, "load", lambda: None)
        torch.manual_seed(5)
        toks = Sampler(64, [2]).sample(logits, rows).token_ids
        freqs.append(torch.bincount(torch.tensor(toks), minlength=64).float() / len(toks))
    for freq in freqs:
        assert freq[3:].sum() == 0, "min-p drops token 3"
        assert torch.allclose(freq[:3], expected[:3], atol=0.025)


def test_plain_random_rows_are_drawn_from_the_logits_as_they_come(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unseeded full-vocabulary rows take one native draw: no float32 copy of the logits."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    calls: list[torch.dtype] = []
    real = sampling._draw_unseeded

    def spy(
        lg: torch.Tensor,
        floors: list[float],
        scales: list[float] | None = None,
        top_p: list[float] | None = None,
    ) -> torch.Tensor:
        calls.append(lg.dtype)
        return real(lg, floors, scales, top_p)

    monkeypatch.setattr(sampling, "_draw_unseeded", spy)
    monkeypatch.setattr(Sampler, "_apply_min_tokens", _boom)  # a step of the general path
    out = Sampler(64, [2]).sample(logits, [Row(SamplingParams(temperature=0.8))] * 4)
    assert calls == [torch.bfloat16] and all(0 <= t < 64 for t in out.token_ids)


def _boom(*args: object, **kwargs: object) -> None:
    raise AssertionError("the general sampling path ran")
