"""The penalty table (``worker_svc.engine.penalties``) held to a reference that penalizes
each row from its token lists, step after step, as the engine drives it: rows joining and
leaving, outputs growing by the drawn tokens (at once, or a step later as with async
scheduling), an output changed behind the table's back, tables outgrown."""

from __future__ import annotations

import collections
import random
from types import SimpleNamespace

import pytest
import torch

from tests.worker_engine.test_sampler import Row
from worker_svc.engine.penalties import PenaltyTable
from worker_svc.engine.sampling import SamplingParams

V = 50


class FlightRow(Row):
    """A row by identity, as ``Request``: the step in flight maps rows to their tokens."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def reference(logits: torch.Tensor, rows: list[Row], late: dict[int, int]) -> torch.Tensor:
    """Each penalized row penalized from its lists (``late``: row -> its token in flight),
    in float32 as the logits."""
    out = logits.clone()
    for i, row in enumerate(rows):
        p = row.sampling_params
        if not p.penalized:
            continue
        rep, freq, presence = torch.tensor([p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
        output = [*row.output_token_ids, *([late[i]] if i in late else [])]
        for t in set(row.prompt_token_ids) | set(output):
            v = out[i, t]
            out[i, t] = v / rep if v > 0 else v * rep
        for t, n in collections.Counter(output).items():
            out[i, t] -= freq * n + presence
    return out


KINDS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.7),
    SamplingParams(temperature=0, frequency_penalty=0.6, presence_penalty=0.4),
    SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=-0.2),
]


def _new_row(rng: random.Random) -> FlightRow:
    prompt = [rng.randrange(V) for _ in range(rng.choice((0, 3, 90)))]  # 90: past the first columns
    output = [rng.randrange(6) for _ in range(rng.choice((0, 0, 5)))]  # 5: resumed with an output
    if not prompt and not output:
        prompt = [rng.randrange(V)]
    return FlightRow(rng.choice(KINDS[1:]), prompt_token_ids=prompt, output_token_ids=output)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_state_across_draws_equals_penalizing_the_lists(ahead: bool) -> None:
    """40 draws of a changing batch of up to 20 rows (slots outgrown), drawn tokens among a
    few ids so counts repeat; each draw's logits equal the reference's. With ``ahead`` a
    drawn token joins its row's output one draw later and is read from the device before.
    A row absent from a draw (preempted) comes back to the next."""
    rng = random.Random(3)
    table = PenaltyTable()
    rows: list[FlightRow] = [_new_row(rng) for _ in range(4)]
    flying: dict[FlightRow, int] = {}  # row -> token drawn and not yet in its output
    prev = SimpleNamespace(tokens=torch.empty(0, dtype=torch.long), rows={})
    penalized_any, paused = False, None
    for step in range(40):
        if paused is not None:
            rows.insert(1, paused)
            paused = None
        elif step % 7 == 3:
            paused = rows.pop(1)
        if step % 5 == 4:  # rows leave (their token in flight dropped), others join
            for row in rng.sample(rows, k=min(2, len(rows))):
                rows.remove(row)
                flying.pop(row, None)
            rows += [_new_row(rng) for _ in range(rng.randrange(1, 6))]
        if step == 23:  # an output the table did not count: a token it never drew
            rows[0].output_token_ids.append(7)
        for row in rows:
            row.in_flight = int(row in flying)
        rows.append(FlightRow(KINDS[0]))  # an unpenalized row among them, a new one each draw
        logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(step)) * 3
        late = {i: flying[r] for i, r in enumerate(rows) if r in flying}
        want = reference(logits, rows, late)
        pen = [i for i, r in enumerate(rows) if r.sampling_params.penalized]
        got = logits.clone()
        applied = table.apply(got, rows, pen, prev if ahead else None)
        assert applied is not None
        assert torch.equal(got, want), f"draw {step}"
        penalized_any |= not torch.equal(got, logits)
        drawn = torch.tensor([rng.randrange(6) for _ in rows])
        table.count(applied, drawn)
        rows.pop()
        for row in flying:
            row.output_token_ids.append(flying[row])
        flying = dict(zip(rows, drawn.tolist(), strict=False))
        if not ahead:
            for row in rows:
                row.output_token_ids.append(flying[row])
            flying = {}
        prev = SimpleNamespace(tokens=drawn, rows={r: i for i, r in enumerate(rows)})
    assert penalized_any and table.held == len(rows)


def test_a_token_in_flight_is_read_from_the_device_when_a_slot_is_filled() -> None:
    """A row first seen with a token in flight counts it from the step in flight, whether
    its output holds that token already (5) or not (9); without that step it is refused."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(12)) * 3
    for late in (5, 9):
        rows = [
            FlightRow(p, prompt_token_ids=[3, 9, 11], output_token_ids=[5, 5, 7], in_flight=1) for p in KINDS
        ]
        rows[3].in_flight = 0
        in_flight = SimpleNamespace(tokens=torch.tensor([1, late, 2, late, 4]), rows={rows[1]: 1, rows[2]: 3})
        want = reference(logits, rows, {1: late, 2: late})
        got = logits.clone()
        PenaltyTable().apply(got, rows, [1, 2, 3], in_flight)
        assert not torch.equal(got, logits), "the penalties changed nothing"
        assert torch.equal(got, want), f"late token {late}"
    with pytest.raises(RuntimeError, match="in flight"):
        PenaltyTable().apply(logits.clone(), rows, [1, 2, 3], None)


def test_a_draw_without_penalized_rows_frees_every_slot() -> None:
    from worker_svc.engine.sampling import Sampler

    sampler = Sampler(V, [2])
    penalized = Row(KINDS[1], prompt_token_ids=[4, 4, 8])
    sampler.sample(torch.randn(2, V), [penalized, Row(KINDS[0])])
    assert sampler.penalties.held == 1
    sampler.sample(torch.randn(1, V), [Row(KINDS[0])])
    assert sampler.penalties.held == 0
