"""A step's inputs to the device in one copy that does not wait for the device.

A host-to-device copy from pageable memory synchronises: PyTorch waits for the stream after
it, so each such copy in a step's preparation waits for every step still queued. With
async scheduling that is the step in flight, whose GPU time the host's preparation of the
next step was meant to overlap. A step's integer inputs instead go into one page-locked
buffer, copied without blocking: the copy queues behind the steps in flight and the
tensors are views of it (docs/design-decisions.md, "Step inputs in one copy").
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["int_tensor", "own", "pinned", "pinned_to", "tensor_on", "to_device"]


def to_device(
    lists: Mapping[str, Sequence[int] | Sequence[Sequence[int]]],
    device: torch.device,
    dtype: torch.dtype = torch.long,
) -> dict[str, torch.Tensor]:
    """Each of ``lists`` (ints, or equally long lists of ints: a matrix) as a ``dtype``
    tensor on ``device``. To a GPU they are views of one copy; on a CPU each is made as
    its own tensor (there is nothing to copy, and views cost more to make)."""
    if device.type == "cpu":
        return {
            name: torch.tensor(values, dtype=dtype) if _nested(values) else int_tensor(values, dtype)  # type: ignore[arg-type]
            for name, values in lists.items()
        }
    flat: list[int] = []
    shapes: dict[str, tuple[int, int, tuple[int, ...]]] = {}
    for name, values in lists.items():
        start = len(flat)
        if _nested(values):
            for row in values:
                flat += row  # type: ignore[arg-type]
            shape: tuple[int, ...] = (len(values), -1)
        else:
            flat += values  # type: ignore[arg-type]
            shape = (-1,)
        shapes[name] = (start, len(flat), shape)
    sent = pinned_to(int_tensor(flat, dtype), device)
    return {name: sent[a:b].view(shape) for name, (a, b, shape) in shapes.items()}


def _nested(values: Sequence[Any]) -> bool:
    return bool(values) and isinstance(values[0], Sequence)


# array typecodes of the integer dtypes int_tensor builds through an array
_ARRAY_CODES = {torch.long: "q", torch.int32: "i"}


def int_tensor(values: Sequence[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` for a flat list of ints, built through an
    ``array.array``: three to four times faster from a few dozen ints up (torch converts
    a list element by element), for the lists every step sends."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values:
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)


def own(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it is a view (of :func:`to_device`'s one copy): a
    compiled forward's inputs are tensors of their own, as it is guarded on a view's base."""
    return t if t._base is None else t.clone()


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` in page-locked memory when it is bound for a GPU (then copy it with
    ``non_blocking=True``: the copy queues behind the work before it instead of waiting)."""
    return t.pin_memory() if device.type != "cpu" and t.device.type == "cpu" else t


def pinned_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from the host to a GPU through page-locked memory, without
    waiting for the work queued before the copy."""
    return pinned(t, device).to(device, non_blocking=True)


def tensor_on(values: Sequence[Any], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without waiting for the device's
    queued work: through page-locked memory to a GPU (a flat list of ints of an integer
    ``dtype`` through :func:`int_tensor`)."""
    flat_ints = dtype in _ARRAY_CODES and not _nested(values)
    host = int_tensor(values, dtype) if flat_ints else torch.tensor(values, dtype=dtype)  # type: ignore[arg-type]
    return pinned_to(host, device)
