"""Multi-LoRA: PEFT-format adapters on the attention and MLP projections, batched.

Each targeted ``nn.Linear`` of the model (``q/k/v/o_proj``, ``gate/up/down_proj`` of every
decoder layer: the Llama family's names, shared by Qwen2/3 and Mistral; a merged part of
one, :mod:`worker_svc.engine.merged_projections`, alike) is replaced by a
:class:`LoraLinear` that holds the A/B weights of ``max_loras`` resident *slots* side by
side: ``A`` stacked as ``[max_loras * max_rank, in]``, ``B`` as ``[out, max_loras * max_rank]``.
One forward serves a mixed batch with three ops per projection, however many adapters the
step uses: ``h = x @ A.T`` for every slot at once, ``h *= mask`` (the step's per-row adapter
index as a one-hot over the slots' columns, carrying each adapter's scaling; all zero on a
base-model row), then ``y += h @ B.T``. On CPU a small matmul costs about the same whatever
its size, so a fixed op count beats two matmuls per adapter present
(docs/design-decisions.md, "LoRA as one masked matmul pair").

:class:`LoraManager` owns the adapters: the names it knows (``register``), a CPU-memory LRU
of ``max_cpu_loras`` loaded adapters (evicted ones are read again from their directory),
and the assignment of adapters to slots (LRU among those the step does not use). An
adapter that does not fit the base model (a module it does not have, other shapes, a rank
above ``max_lora_rank``, a PEFT feature not served) is refused with :class:`LoraError`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker_svc.engine.host_copy import pinned, pinned_to
from worker_svc.engine.merged_projections import MergedPart

__all__ = [
    "TARGET_MODULES",
    "LoraAdapter",
    "LoraError",
    "LoraLinear",
    "LoraManager",
    "LoraSnapshot",
    "LoraStateError",
    "UnknownLoraError",
    "load_adapter",
]

# Projection name -> its parent module in a decoder layer (Llama-family naming).
TARGET_MODULES: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_MODULE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_WEIGHT_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# adapter_config.json fields whose non-default values we cannot serve exactly.
_REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_dora": (None, False),
    "bias": (None, "none"),
    "modules_to_save": (None, [], ()),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layers_to_transform": (None,),
    "fan_in_fan_out": (None, False),
    "lora_bias": (None, False),
    "target_parameters": (None, []),
    "trainable_token_indices": (None,),
    "layer_replication": (None,),
    "alora_invocation_tokens": (None,),
}
Key = tuple[int, str]  # (layer index, projection name)


class LoraError(ValueError):
    """An adapter that cannot be loaded or served (the message names it and why)."""


class UnknownLoraError(LoraError):
    """A request or command names an adapter this engine does not know."""


class LoraStateError(LoraError):
    """The command cannot apply in the engine's state (LoRA off, adapter in use)."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights in CPU memory: per (layer, projection) ``(A [r, in], B [out, r])``."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[Key, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Bytes its weights take."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(name: str, path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except OSError as exc:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {cfg_path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise LoraError(f"LoRA adapter {name!r}: {cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"LoRA adapter {name!r}: {cfg_path} is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for key, allowed in _REFUSED_FIELDS.items():
        if cfg.get(key) not in allowed:
            raise LoraError(f"LoRA adapter {name!r}: {key}={cfg.get(key)!r} is not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoraError(f"LoRA adapter {name!r}: r={r!r} must be a positive int")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha={alpha!r} must be a number")
    return cfg


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    st = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st):
        raise LoraError(f"LoRA adapter {name!r}: {st} not found (only safetensors adapters are served)")
    try:
        return load_file(st, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {st}: {exc}") from None


def load_adapter(
    name: str, path: str, shapes: dict[Key, tuple[int, int]], max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """Read and check a PEFT adapter directory against the base model's projection
    ``shapes`` ((layer, proj) -> (in_features, out_features)); LoraError names what is wrong."""
    cfg = _read_config(name, path)
    rank = int(cfg["r"])
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {name!r}: rank {rank} exceeds max_lora_rank={max_rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    pairs: dict[Key, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in _read_tensors(name, path).items():
        m = _WEIGHT_RE.search(tensor_name)
        if m is None or m.group(3) not in TARGET_MODULES or m.group(2) != TARGET_MODULES[m.group(3)]:
            raise LoraError(
                f"LoRA adapter {name!r}: tensor {tensor_name!r} targets a module LoRA is not served on"
            )
        key = (int(m.group(1)), m.group(3))
        if key not in shapes:
            raise LoraError(
                f"LoRA adapter {name!r}: tensor {tensor_name!r}: the base model has no such layer"
            )
        pairs.setdefault(key, {})[m.group(4)] = tensor
    if not pairs:
        raise LoraError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    weights: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: layer {key[0]} {key[1]} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[key]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraError(
                f"LoRA adapter {name!r}: layer {key[0]} {key[1]} has A {tuple(a.shape)} / B {tuple(b.shape)}, "
                f"the base model needs ({rank}, {fan_in}) / ({fan_out}, {rank})"
            )
        weights[key] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return LoraAdapter(name, path, rank, scaling, weights)


@dataclass(frozen=True)
class LoraSnapshot:
    """The adapters of an engine at one moment (read by other threads than the engine's)."""

    loaded: tuple[str, ...]
    resident: tuple[str, ...]
    cpu_cached: tuple[str, ...]
    max_loras: int
    num_loads: int
    num_evictions: int


def _slot_columns(slot: int, max_rank: int) -> slice:
    """The columns of (1-based) ``slot`` in a LoraLinear's side-by-side A rows / B columns
    and in a step's mask."""
    return slice((slot - 1) * max_rank, slot * max_rank)


class _Bank:
    """The A/B weights of one projection name and shape across the layers, stacked:
    ``a [layers, slots * max_rank, in]``, ``b [layers, out, slots * max_rank]``."""

    def __init__(self, layers: int, width: int, fan_in: int, fan_out: int, like: torch.Tensor) -> None:
        self.a = torch.zeros(layers, width, fan_in, dtype=like.dtype, device=like.device)
        self.b = torch.zeros(layers, fan_out, width, dtype=like.dtype, device=like.device)
        for t in (self.a, self.b):
            torch._dynamo.mark_static(t)


@dataclass
class _LoraState:
    """One manager's banks (by projection name and shape) and the current step's mask.

    The mask is None outside a step and on a base-only eager step; ``[rows, every slot *
    max_rank]`` on every other step (on every step of a compiled forward: LoraManager
    ``static``)."""

    banks: dict[str, _Bank]
    mask: torch.Tensor | None = None


# Every manager's state, by serial. LoraLinear reads its weights and the step's mask
# through this module global, not through the model's modules: a compiled forward takes
# tensors it reaches through a global as inputs, read afresh each call, while it folds
# those it reaches through a module into the graph as constants (freezing), so a slot
# loaded later or the next step's mask would never reach it (docs/design-decisions.md,
# "LoRA inside the compiled forward").
_STATES: dict[int, _LoraState] = {}
_SERIAL = itertools.count()


class LoraLinear(nn.Module):
    """``base(x)`` plus each row's adapter delta ``B (A x) * scaling`` (module docstring)."""

    def __init__(
        self, base: nn.Linear | MergedPart, max_rank: int, owner: int, bank: str, index: int
    ) -> None:
        super().__init__()
        self.base = base
        self.max_rank = max_rank
        self._owner = owner  # its manager's serial in _STATES
        self._bank = bank  # its bank's key there
        self._index = index  # its layer's row in the bank

    @property
    def lora_a(self) -> torch.Tensor:
        """``[slots * max_rank, in_features]``: every slot's A, side by side."""
        return _STATES[self._owner].banks[self._bank].a[self._index]

    @property
    def lora_b(self) -> torch.Tensor:
        """``[out_features, slots * max_rank]``: every slot's B, side by side."""
        return _STATES[self._owner].banks[self._bank].b[self._index]

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy an adapter's (A, B) into ``slot`` (1-based; None: the adapter does not
        target this module). Ranks below ``max_rank`` leave zero columns: they add nothing."""
        cols = _slot_columns(slot, self.max_rank)
        lora_a, lora_b = self.lora_a, self.lora_b
        lora_a[cols].zero_()
        lora_b[:, cols].zero_()
        if weights is None:
            return
        a, b = (pinned(w, lora_a.device) for w in weights)  # host weights: no wait for the device
        lora_a[cols.start : cols.start + a.shape[0]].copy_(a, non_blocking=True)
        lora_b[:, cols.start : cols.start + b.shape[1]].copy_(b, non_blocking=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask = _STATES[self._owner].mask
        if mask is None:
            return y
        h = nn.functional.linear(x.reshape(-1, x.shape[-1]), self.lora_a)
        h.mul_(mask)
        y.view(-1, y.shape[-1]).addmm_(h, self.lora_b.t())
        return y


class LoraManager:
    """Adapters of one engine: known names, CPU LRU, resident slots and the step's grouping."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int, static: bool = False
    ) -> None:
        self.max_loras = max_loras
        # Static: every step, base-only ones included, gets a mask spanning every slot, so
        # a compiled forward sees the same inputs each step (its mask is a graph input).
        self.static = static
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.serial = next(_SERIAL)
        self._state = _STATES[self.serial] = _LoraState({})
        weakref.finalize(self, _STATES.pop, self.serial, None)
        self.layers: dict[Key, LoraLinear] = _wrap_projections(
            model, max_loras, max_rank, self.serial, self._state
        )
        if not self.layers:
            raise LoraError(
                "LoRA is enabled but the model has no q/k/v/o or gate/up/down projection to adapt"
            )
        self.shapes = {k: (m.base.in_features, m.base.out_features) for k, m in self.layers.items()}
        self.dtype: torch.dtype = next(iter(self.layers.values())).base.weight.dtype
        self.paths: dict[str, str] = {}  # registered name -> directory
        self.cpu: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU, most recent last
        self.slots: list[str | None] = [None] * (max_loras + 1)  # slot 0 never holds an adapter
        self.scalings: list[float] = [0.0] * (max_loras + 1)  # each slot's adapter's scaling
        self._slot_use: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, max_loras + 1))
        self.num_loads = 0  # adapters copied into a slot
        self.num_evictions = 0  # resident adapters replaced in their slot

    @property
    def step_mask(self) -> torch.Tensor | None:
        """The mask of the step under way (None outside a step, or a base-only eager one)."""
        return self._state.mask

    # ------------------------------------------------------------ registry
    def register(self, name: str, path: str) -> LoraAdapter:
        """Load and check ``path`` as adapter ``name``; LoraError when the name is taken or
        the adapter does not fit the base model."""
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise LoraError(f"LoRA adapter name {name!r} must be a non-empty string without spaces")
        if name in self.paths:
            raise LoraError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.shapes, self.max_rank, self.dtype)
        self.paths[name] = path
        self._cache(adapter)
        return adapter

    def unregister(self, name: str) -> None:
        """Forget adapter ``name`` (the caller makes sure no request uses it)."""
        if name not in self.paths:
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded")
        del self.paths[name]
        self.cpu.pop(name, None)
        if name in self.slots:
            slot = self.slots.index(name)
            self.slots[slot] = None
            for layer in self.layers.values():
                layer.set_slot(slot, None)

    def known(self, name: str) -> bool:
        """Whether requests may name adapter ``name``."""
        return name in self.paths

    def resident(self) -> list[str]:
        """Adapters in a slot now."""
        return [n for n in self.slots if n is not None]

    def cpu_cached(self) -> list[str]:
        """Adapters in the CPU LRU, least recently used first."""
        return list(self.cpu)

    def snapshot(self) -> LoraSnapshot:
        """Names and counters now (call on the engine thread)."""
        return LoraSnapshot(
            tuple(self.paths),
            tuple(self.resident()),
            tuple(self.cpu),
            self.max_loras,
            self.num_loads,
            self.num_evictions,
        )

    def _cache(self, adapter: LoraAdapter) -> None:
        self.cpu[adapter.name] = adapter
        self.cpu.move_to_end(adapter.name)
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def _cpu_adapter(self, name: str) -> LoraAdapter:
        adapter = self.cpu.get(name)
        if adapter is None:  # evicted from the CPU LRU: read again
            adapter = load_adapter(name, self.paths[name], self.shapes, self.max_rank, self.dtype)
        self._cache(adapter)
        return adapter

    # ---------------------------------------------------------------- steps
    def _slot_of(self, name: str, keep: set[int]) -> int:
        """``name``'s slot, loading it into an empty slot or the least recently used one not in ``keep``."""
        if name in self.slots:
            slot = self.slots.index(name)
        else:
            # The lowest empty slot, else the least recently used one.
            empty = [s for s in range(1, self.max_loras + 1) if self.slots[s] is None]
            slot = empty[0] if empty else next(s for s in self._slot_use if s not in keep)
            adapter = self._cpu_adapter(name)
            if self.slots[slot] is not None:
                self.num_evictions += 1
            for key, layer in self.layers.items():
                layer.set_slot(slot, adapter.weights.get(key))
            self.slots[slot] = name
            self.scalings[slot] = adapter.scaling
            self.num_loads += 1
        self._slot_use.move_to_end(slot)
        return slot

    def step_rows(self, spans: Sequence[tuple[str, int]], full: bool = False) -> torch.Tensor | None:
        """The mask of a step's packed rows, each span's adapter loaded into a slot first.
        ``spans``: one ``(adapter name or "", number of rows)`` per scheduled chunk, in
        order. Always every slot's columns: the products then have one shape whatever the
        step's adapters, so eager and compiled forwards round them alike (cuBLAS picks its
        kernel, and with it the order of each sum, by shape). None when no row has an
        adapter, unless ``full`` or ``static``. On the host (the caller moves it)."""
        names = {n for n, _ in spans if n}
        if len(names) > self.max_loras:
            raise LoraError(f"a step uses {len(names)} LoRA adapters, max_loras={self.max_loras}")
        full = full or self.static
        if not names and not full:
            return None
        keep: set[int] = {self.slots.index(n) for n in names if n in self.slots}
        mask = torch.zeros(sum(n for _, n in spans), self.max_loras * self.max_rank, dtype=self.dtype)
        start = 0
        for name, n in spans:
            if name:
                slot = self._slot_of(name, keep)
                keep.add(slot)
                mask[start : start + n, _slot_columns(slot, self.max_rank)] = self.scalings[slot]
            start += n
        return mask

    @contextmanager
    def masked(self, mask: torch.Tensor | None) -> Iterator[None]:
        """Within: the forward applies ``mask`` (as `step_rows` makes it, on the model's device)."""
        self._state.mask = mask
        try:
            yield
        finally:
            self._state.mask = None

    def step(self, spans: Sequence[tuple[str, int]], device: torch.device) -> AbstractContextManager[None]:
        """Within: the forward applies each span's adapter (`step_rows`)."""
        mask = self.step_rows(spans)
        return self.masked(None if mask is None else pinned_to(mask, device))


def _wrap_projections(
    model: nn.Module, max_loras: int, max_rank: int, owner: int, state: _LoraState
) -> dict[Key, LoraLinear]:
    """Replace every targeted projection of ``model`` by a LoraLinear around it, the
    projections of one name and shape sharing a bank of ``state``."""
    found: list[tuple[str, int, str, nn.Linear | MergedPart]] = []
    for mod_name, module in model.named_modules():
        m = _MODULE_RE.search(mod_name)
        if m and m.group(3) in TARGET_MODULES and m.group(2) == TARGET_MODULES[m.group(3)]:
            if isinstance(module, nn.Linear | MergedPart):
                found.append((mod_name, int(m.group(1)), m.group(3), module))
    groups: dict[tuple[str, int, int], list[tuple[str, int, nn.Linear | MergedPart]]] = {}
    for mod_name, layer, proj, linear in found:
        groups.setdefault((proj, linear.in_features, linear.out_features), []).append(
            (mod_name, layer, linear)
        )
    layers: dict[Key, LoraLinear] = {}
    for (proj, fan_in, fan_out), members in groups.items():
        key = f"{proj}:{fan_in}:{fan_out}"
        state.banks[key] = _Bank(len(members), max_loras * max_rank, fan_in, fan_out, members[0][2].weight)
        for index, (mod_name, layer, linear) in enumerate(members):
            wrapped = LoraLinear(linear, max_rank, owner, key, index)
            setattr(model.get_submodule(mod_name.rsplit(".", 1)[0]), proj, wrapped)
            layers[(layer, proj)] = wrapped
    return layers
