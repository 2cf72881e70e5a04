"""Projections that read the same input merged into one matmul: q/k/v and gate/up.

A transformers decoder layer calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` one after
the other, and its MLP ``gate_proj(x)`` and ``up_proj(x)``. Each call is a GEMM reading
its own weight; at a decode step of a few rows a small GEMM (k/v of a GQA model) runs far
below the memory bandwidth, and each is a kernel launch. Merged at load, as vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` are, a layer runs one GEMM for q/k/v
and one for gate/up (docs/design-decisions.md, "Merged projections").

The model's own forward is not rewritten: each original projection becomes a
:class:`MergedPart` of a :class:`MergedLinear` registered beside them (``qkv_proj``,
``gate_up_proj``). The first part called with an input computes the whole merged product
and keeps its slices until every part has taken its own; a part called with another input
computes the product afresh, so any calling order gives the separate projections' result.
Under ``torch.compile`` the same code traces into one matmul per group.

:func:`check_merged` runs after the runner's load-time probe forward: a group whose
product was computed other than once, or whose parts were not all taken, is unmerged (its
parts then multiply by their own rows of the merged weight, a view, no copy).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GROUPS", "MergedLinear", "MergedPart", "check_merged", "merge_projections"]

log = logging.getLogger(__name__)

# Sibling projections that read the same input -> the merged module's name beside them.
GROUPS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
)


class _Product:
    """The merged product of the last input, until each part has taken its slice.

    A plain object (no module, no ``__slots__``): the compiled forward stores these
    attributes back after each call, and a module's ``__setattr__`` would cost that on
    every step; plain attributes are what every torch version's compiler traces."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()
        self.left = 0


class MergedLinear(nn.Module):
    """Sibling ``nn.Linear`` layers of one input as one: their weights (and biases) stacked."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.sizes = tuple(m.out_features for m in linears)
        self.in_features = linears[0].in_features
        self.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
        biases = [m.bias for m in linears]
        stacked = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        self.bias = None if stacked is None else nn.Parameter(stacked, requires_grad=False)
        self.computes = 0  # eager products since the last check (check_merged)
        self._product = _Product()

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Part ``index`` of the merged product of ``x`` (computed once for all parts)."""
        product = self._product
        if product.input is not x or product.left == 0:
            product.parts = F.linear(x, self.weight, self.bias).split(self.sizes, -1)
            product.input, product.left = x, len(self.sizes)
            if not torch.compiler.is_compiling():
                self.computes += 1
        out = product.parts[index]
        product.left -= 1
        if product.left == 0:  # every part taken: hold no activations between calls
            product.input, product.parts = None, ()
        return out


class MergedPart(nn.Module):
    """One original projection of a :class:`MergedLinear`: its rows of the product."""

    def __init__(self, merged: MergedLinear, index: int) -> None:
        super().__init__()
        # Not a submodule: the merged module is registered once, beside its parts.
        self.__dict__["merged"] = merged
        self.index = index
        start = sum(merged.sizes[:index])
        self.in_features, self.out_features = merged.in_features, merged.sizes[index]
        rows = slice(start, start + self.out_features)
        # Views of the merged tensors (unregistered: the merged module owns them): what an
        # unmerged part multiplies by, and its dtype and device for LoRA's weights.
        self.__dict__["weight"] = nn.Parameter(merged.weight[rows], requires_grad=False)
        bias = None if merged.bias is None else nn.Parameter(merged.bias[rows], requires_grad=False)
        self.__dict__["bias"] = bias
        self.merged_on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged_on:
            return self.merged.part(x, self.index)
        return F.linear(x, self.weight, self.bias)


def _mergeable(linears: list[nn.Module]) -> bool:
    """Plain linears (no quantized or wrapped class) of one input size, dtype and device,
    with biases on all or none."""
    if not all(type(m) is nn.Linear for m in linears):
        return False
    first = linears[0]
    same = all(
        m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in linears
    )
    return same


def merge_projections(model: nn.Module) -> list[MergedLinear]:
    """Merge every group of :data:`GROUPS` found as siblings in ``model``, in place."""
    merged: list[MergedLinear] = []
    for parent in list(model.modules()):
        for names, merged_name in GROUPS:
            linears = [getattr(parent, n, None) for n in names]
            if hasattr(parent, merged_name) or not _mergeable(linears):
                continue
            group = MergedLinear(linears)  # type: ignore[arg-type]
            setattr(parent, merged_name, group)
            for index, name in enumerate(names):
                setattr(parent, name, MergedPart(group, index))
            merged.append(group)
    return merged


def check_merged(model: nn.Module, merged: list[MergedLinear]) -> list[MergedLinear]:
    """After exactly one eager forward since merging: the groups whose product was computed
    once with every part taken stay merged; the others are unmerged (logged). Returns the
    groups still merged."""
    parts: dict[int, list[MergedPart]] = {}
    for module in model.modules():
        if isinstance(module, MergedPart):
            parts.setdefault(id(module.merged), []).append(module)
    kept = []
    for group in merged:
        ok = group.computes == 1 and group._product.left == 0
        group.computes = 0
        group._product = _Product()
        if ok:
            kept.append(group)
            continue
        log.warning("projections of sizes %s read different inputs: left unmerged", group.sizes)
        for part in parts.get(id(group), []):
            part.merged_on = False
    return kept
