"""A step's inputs to the device (worker_svc/engine/host_copy.py): each list becomes the
tensor it names, a list of rows a matrix; the forward's inputs are tensors of their own.
On a GPU the same calls go through one page-locked copy (checked there by the GPU kit's
sync_points and the engine tests)."""

from __future__ import annotations

import pytest
import torch

from worker_svc.engine.host_copy import own, pinned_to, tensor_on, to_device

DEVICES = ["cpu"] + ["cuda"] * torch.cuda.is_available()


@pytest.mark.parametrize("device", DEVICES)
def test_each_list_becomes_its_tensor(device: str) -> None:
    sent = to_device(
        {"ids": [[5, 6, 7]], "late": [(0, 2), (2, 1)], "empty": [], "lens": [9]}, torch.device(device)
    )
    assert sent["ids"].tolist() == [[5, 6, 7]] and sent["ids"].dtype == torch.long
    assert sent["late"].tolist() == [[0, 2], [2, 1]]
    assert sent["empty"].numel() == 0 and sent["lens"].tolist() == [9]
    halves = to_device({"a": [1, 2], "b": [3]}, torch.device(device), torch.int32)
    assert halves["b"].dtype == torch.int32 and halves["b"].tolist() == [3]


@pytest.mark.parametrize("device", DEVICES)
def test_own_copies_a_view_only(device: str) -> None:
    whole = torch.arange(6, device=device)
    view = whole[2:5].view(1, -1)
    copied = own(view)
    assert copied._base is None and copied.tolist() == [[2, 3, 4]]
    copied[0, 0] = 99
    assert int(whole[2]) == 2  # a copy, not the view
    fresh = torch.zeros(3, device=device)
    assert own(fresh) is fresh


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_on_and_pinned_to_keep_values_and_dtype(device: str) -> None:
    dev = torch.device(device)
    t = tensor_on([0.5, 2.0], dev, torch.bfloat16)
    assert t.device.type == device and t.dtype == torch.bfloat16 and t.tolist() == [0.5, 2.0]
    assert pinned_to(t, dev) is t  # already there: no copy
    assert pinned_to(torch.tensor([1, 2]), dev).tolist() == [1, 2]
