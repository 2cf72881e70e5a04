"""Repetition, frequency and presence penalties from per-request state kept on the logits'
device.

Semantics: repetition as HF's (over the prompt and the output: a positive logit of a token
seen is divided by the penalty, a negative one multiplied), then frequency and presence as
OpenAI's (over the output only: ``logit -= freq * count + presence * (count > 0)``).

Each penalized request holds a slot of a :class:`PenaltyTable`: the distinct token ids of
its prompt and output (the slot's first ``length`` columns) and how often its output holds
each. A slot is filled from the host once, when its request is first drawn, and again only
if its output is no longer what the slot counted; after that every draw adds the drawn
tokens on the device. So a step's host work is one slot index per penalized row, whatever
the prompts' and outputs' lengths, and a token still in flight (async scheduling) is counted
without being read back (docs/design-decisions.md, "Penalties from state on the device").
A step's device work is proportional to its rows' distinct tokens, not to the vocabulary.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker_svc.engine.host_copy import tensor_on, to_device

if TYPE_CHECKING:  # the sampler's protocols (it imports this module)
    from worker_svc.engine.sampling import SamplingState, TokensInFlight

__all__ = ["PenaltyStep", "PenaltyTable"]


@dataclass
class _Slot:
    row: SamplingState  # held: its id keys the slot
    index: int
    counted: int  # output tokens the slot holds, drawn ones still in flight included
    width: int  # an upper bound of its distinct tokens: the columns it may use


@dataclass
class PenaltyStep:
    """One draw's penalized rows, kept for :meth:`PenaltyTable.count`."""

    slots: list[_Slot]
    at: torch.Tensor | None  # the rows of the logits, None: every row in order
    index: torch.Tensor  # their slots on the device
    # [rows, width] their slots' columns as applied: a column past a slot's length reads
    # its first column's token and count, so it writes the value the first column writes.
    tokens: torch.Tensor
    counts: torch.Tensor


def _drawn(row: SamplingState) -> int:
    return len(row.output_token_ids) + row.in_flight


class PenaltyTable:
    """Slots of penalized requests: their distinct tokens, output counts and penalty
    factors on the device. :meth:`apply` penalizes a draw's logits, :meth:`count` adds the
    tokens drawn; a request absent from a draw with penalized rows loses its slot."""

    def __init__(self) -> None:
        self.release_all()

    @property
    def held(self) -> int:
        """Slots in use."""
        return len(self._slots)

    def release_all(self) -> None:
        """Every slot freed and the tables dropped (a draw with no penalized row)."""
        self._slots: dict[int, _Slot] = {}
        self._free: list[int] = []
        self._capacity = self._columns = 0
        self._index_cache: tuple[tuple[int, ...], torch.Tensor] | None = None
        self.tokens = self.counts = self.lengths = self.factors = torch.empty(0)

    def apply(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingState],
        pen: list[int],
        in_flight: TokensInFlight | None,
    ) -> PenaltyStep | None:
        """Penalizes rows ``pen`` of float ``logits`` (one row per ``rows``) in place; None
        when none has a token to penalize. A row's token in flight is read from
        ``in_flight`` on the device when its slot is filled; later ones were counted when
        drawn."""
        pen = [i for i in pen if rows[i].prompt_token_ids or rows[i].output_token_ids or rows[i].in_flight]
        pen_rows = [rows[i] for i in pen]
        self._keep({id(r) for r in pen_rows})
        if not pen:
            return None
        fills = [r for r in pen_rows if self._stale(r)]
        need = max(len(r.prompt_token_ids) + _drawn(r) for r in fills) + 1 if fills else 0
        self._reserve(logits, len(self._slots) + len(fills), need)
        if fills:
            self._fill(fills, in_flight)
        slots = [self._slots[id(r)] for r in pen_rows]
        index = self._index([s.index for s in slots], logits.device)
        step = self._block(slots, index, None if len(pen) == len(rows) else tensor_on(pen, logits.device))
        rep, freq, presence = self.factors.index_select(0, index).unsqueeze(2).unbind(1)
        vals = logits.gather(1, step.tokens) if step.at is None else logits[step.at.unsqueeze(1), step.tokens]
        # HF's rule (positive / rep, negative * rep) picks the smaller value for rep >= 1.
        if any(s.row.sampling_params.repetition_penalty < 1.0 for s in slots):
            repeated = torch.where(vals > 0, vals / rep, vals * rep)
        else:
            repeated = torch.minimum(vals / rep, vals * rep)
        new = repeated - (step.counts * freq + step.counts.clamp(max=1.0) * presence)
        if step.at is None:
            logits.scatter_(1, step.tokens, new)
        else:
            logits[step.at.unsqueeze(1), step.tokens] = new
        return step

    def count(self, step: PenaltyStep, drawn: torch.Tensor) -> None:
        """Adds the tokens ``drawn`` (one per row of the draw, on the device) to the rows'
        slots: a token seen before counts once more, a new one takes the column after the
        slot's length (where a seen one writes what no step reads)."""
        token = drawn if step.at is None else drawn[step.at]
        seen = step.tokens == token.unsqueeze(1)
        self.counts[:, : seen.shape[1]].index_copy_(0, step.index, step.counts + seen)
        length = self.lengths[step.index]
        self.tokens[step.index, length] = token
        self.counts[step.index, length] = 1.0
        self.lengths[step.index] = length + (~seen.any(1)).to(length.dtype)
        for slot in step.slots:
            slot.counted += 1
            slot.width += 1

    def _block(self, slots: list[_Slot], index: torch.Tensor, at: torch.Tensor | None) -> PenaltyStep:
        """The slots' columns up to the widest one's, each past its length reading its first."""
        width = max(s.width for s in slots)
        tokens = self.tokens[:, :width].index_select(0, index)
        counts = self.counts[:, :width].index_select(0, index)
        past = torch.arange(width, device=index.device) >= self.lengths[index].unsqueeze(1)
        tokens = torch.where(past, tokens[:, :1], tokens)
        return PenaltyStep(slots, at, index, tokens, torch.where(past, counts[:, :1], counts))

    def _stale(self, row: SamplingState) -> bool:
        """Whether the row's slot is missing or counts another output than the row's (a
        draw whose token was never kept, an output made elsewhere): then it is filled."""
        slot = self._slots.get(id(row))
        return slot is None or slot.counted != _drawn(row)

    def _keep(self, keys: set[int]) -> None:
        for key in [k for k in self._slots if k not in keys]:
            self._free.append(self._slots.pop(key).index)

    def _reserve(self, like: torch.Tensor, slots: int, columns: int) -> None:
        """Tables of at least ``slots`` rows and ``columns`` columns, grown by doubling
        (each slot's drawn token needs the column after its width)."""
        columns = max(columns, max((s.width for s in self._slots.values()), default=0) + 1)
        if slots <= self._capacity and columns <= self._columns:
            return
        rows = max(slots, 2 * self._capacity, 8) if slots > self._capacity else self._capacity
        cols = max(columns, 2 * self._columns, 64) if columns > self._columns else self._columns
        dev = like.device
        grown = {
            "tokens": torch.zeros(rows, cols, dtype=torch.long, device=dev),
            "counts": torch.zeros(rows, cols, dtype=like.dtype, device=dev),
            "lengths": torch.zeros(rows, dtype=torch.long, device=dev),
            "factors": torch.ones(rows, 3, dtype=like.dtype, device=dev),
        }
        for name, table in grown.items():
            old = getattr(self, name)
            if old.numel():
                table[tuple(slice(0, n) for n in old.shape)] = old
            setattr(self, name, table)
        self._free += range(self._capacity, rows)
        self._capacity, self._columns = rows, cols

    def _fill(self, rows: list[SamplingState], in_flight: TokensInFlight | None) -> None:
        """The rows' slots from the host: prompt and output tokens with the output's
        counts, the factors; a token in flight then counted from the device."""
        lists: dict[str, list[int]] = {k: [] for k in ("slot", "col", "token", "count", "at", "length")}
        factors, late_slots, late_at = [], [], []
        for row in rows:
            output = collections.Counter(row.output_token_ids)
            distinct = dict.fromkeys(row.prompt_token_ids, 0) | output
            if not distinct:  # its token in flight would have no column to compare with
                raise ValueError("a penalized row with a token in flight has no other token")
            old = self._slots.pop(id(row), None)
            slot = _Slot(
                row, old.index if old else self._free.pop(), len(row.output_token_ids), len(distinct)
            )
            self._slots[id(row)] = slot
            lists["slot"] += [slot.index] * len(distinct)
            lists["col"] += range(len(distinct))
            lists["token"] += distinct
            lists["count"] += distinct.values()
            lists["at"].append(slot.index)
            lists["length"].append(len(distinct))
            p = row.sampling_params
            factors.append([p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
            if row.in_flight:
                if in_flight is None or row not in in_flight.rows:
                    raise RuntimeError("a penalized row's token in flight is in no step")
                late_slots.append(slot)
                late_at.append(in_flight.rows[row])
        dev = self.tokens.device
        sent = to_device(lists, dev)
        self.tokens[sent["slot"], sent["col"]] = sent["token"]
        self.counts[sent["slot"], sent["col"]] = sent["count"].to(self.counts.dtype)
        self.lengths[sent["at"]] = sent["length"]
        self.factors[sent["at"]] = tensor_on(factors, dev, self.factors.dtype)
        if late_slots:
            assert in_flight is not None
            index = tensor_on([s.index for s in late_slots], dev, torch.long)
            late = in_flight.tokens[tensor_on(late_at, dev, torch.long)]
            self.count(self._block(late_slots, index, None), late)

    def _index(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """The slots as an index tensor, the last one's again when they are the same (a
        steady batch)."""
        key = tuple(slots)
        if self._index_cache is None or self._index_cache[0] != key:
            self._index_cache = (key, tensor_on(slots, device, torch.long))
        return self._index_cache[1]
