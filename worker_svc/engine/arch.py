"""Which transformers causal LMs the paged attention can serve, and how each layer attends.

The paged attention replaces transformers' attention *and* its masks (the model passes
``attention_mask=None``, see :mod:`worker_svc.engine.attention`), so everything the mask
would have encoded -- causality, a sliding window per layer -- must be known here, and
everything the attention function is handed -- ``scaling``, ``softcap``, attention sinks
(``s_aux``) -- must be honoured there. A model with an attention feature outside that set
would silently produce wrong tokens; it is refused at load instead
(:class:`UnsupportedModelError` names the architecture and the feature).

Three checks, all explicit allow-lists:

* the model class routes attention through ``AttentionInterface``
  (``_supports_attention_backend``; Falcon, MPT, Bloom, GPT-J do not);
* every attention-looking config attribute (:data:`_ATTENTION_KEY`) is one this module
  understands (:data:`UNDERSTOOD_KEYS`), with a value it can serve;
* at load, one probe forward pass shows that every layer calls the paged attention once,
  with only keyword arguments it understands (``attention.KNOWN_KWARGS``) and with the
  sliding window the config promised (checked in :mod:`worker_svc.engine.model_runner`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "UNDERSTOOD_KEYS",
    "AttentionSpec",
    "UnsupportedModelError",
    "attention_spec",
    "check_model_class",
    "check_multimodal",
]


class UnsupportedModelError(ValueError):
    """The model's attention cannot be served correctly by the paged attention."""

    def __init__(self, architecture: str, feature: str) -> None:
        super().__init__(f"meshserve cannot serve {architecture}: {feature}")
        self.architecture = architecture
        self.feature = feature


# Config attribute names that can change what attention computes. Any attribute whose
# name matches must be listed below, or the model is refused.
_ATTENTION_KEY = re.compile(
    r"attn|attention|window|sink|alibi|softcap|chunk|bidirectional|causal|sparse|layer_types|pattern"
)

# Attribute -> why it is safe. Values are checked separately where only some are served.
UNDERSTOOD_KEYS: dict[str, str] = {
    "num_attention_heads": "head count; K/V cache layout",
    "attention_bias": "projection bias, inside the module",
    "attention_dropout": "dropout is off in inference",
    "attn_pdrop": "dropout is off in inference",
    "attention_probs_dropout_prob": "dropout is off in inference",
    "output_attentions": "the runner never asks for attention weights",
    "attention_multiplier": "Granite: folded into the module's scaling",
    "query_pre_attn_scalar": "Gemma: folded into the module's scaling",
    "scale_attn_weights": "GPT-2: folded into the module's scaling",
    "scale_attn_by_inverse_layer_idx": "GPT-2: folded into the module's scaling",
    "reorder_and_upcast_attn": "GPT-2: numerics of transformers' eager path only",
    "attn_logit_softcapping": "passed to the attention function as softcap where the model uses it",
    "final_logit_softcapping": "applied to the logits by the model, not in attention",
    "sliding_window": "per-layer window, honoured by the paged attention",
    "use_sliding_window": "Qwen-style switch for sliding_window",
    "max_window_layers": "Qwen-style: already expanded into layer_types",
    "layer_types": "per-layer full / sliding attention",
    "sliding_window_pattern": "Gemma 3: already expanded into layer_types",
    "_sliding_window_pattern": "Gemma 3: already expanded into layer_types",
    "use_bidirectional_attention": "served only when off (causal)",
    "add_cross_attention": "served only when off",
    "chunk_size_feed_forward": "feed-forward chunking, not attention",
    "decoder_sparse_step": "MoE layer placement, not attention",
}

# Attributes served only with these values (anything else is a feature we lack).
_REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "use_bidirectional_attention": (None, False),
    "add_cross_attention": (None, False),
}

# layer_types entries -> whether the layer is windowed.
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}

_DEFAULT_MAX_POSITIONS = 2048

# Vision-language families whose language model attends causally over the merged image
# embeddings with plain 1-D positions -- what the decoder's language-model-only load
# computes. Others are refused: Gemma 3 / PaliGemma let image tokens attend to each other
# bidirectionally, Qwen2-VL-style models use 3-D (M-RoPE) positions.
MULTIMODAL_TYPES = frozenset({"llava", "llava_next", "llava_onevision", "mistral3"})


@dataclass(frozen=True)
class AttentionSpec:
    """How each layer of a supported model attends.

    ``layer_windows[i]`` is the sliding window of layer ``i`` (a query at position ``p``
    sees keys ``p - window < k <= p``, as transformers' sliding mask), or None for full
    causal attention. ``max_positions`` is the model's own context limit.
    """

    architecture: str
    layer_windows: tuple[int | None, ...]
    max_positions: int

    @property
    def has_sliding_layers(self) -> bool:
        """True when at least one layer attends through a sliding window."""
        return any(w is not None for w in self.layer_windows)


def architecture_name(cfg: Any) -> str:
    """The config's architecture (``architectures[0]``), or its model_type."""
    archs = getattr(cfg, "architectures", None) or []
    return str(archs[0]) if archs else str(getattr(cfg, "model_type", type(cfg).__name__))


def check_model_class(model_cls: type, architecture: str) -> None:
    """Refuse a model class whose attention does not go through ``AttentionInterface``
    (the paged attention would never be called: KeyError or, worse, full attention)."""
    if not getattr(model_cls, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            architecture,
            f"{model_cls.__name__} does not route attention through transformers' AttentionInterface, "
            "so the paged attention cannot be plugged in",
        )


def check_multimodal(model_type: str, architecture: str) -> None:
    """Refuse a vision-language checkpoint whose language model does not attend causally
    over image embeddings at 1-D positions (see :data:`MULTIMODAL_TYPES`)."""
    if model_type not in MULTIMODAL_TYPES:
        raise UnsupportedModelError(
            architecture,
            f"vision-language model_type {model_type!r} is not a LLaVA-style causal LM over image "
            f"embeddings (served: {sorted(MULTIMODAL_TYPES)})",
        )


def attention_spec(cfg: Any, architecture: str | None = None) -> AttentionSpec:
    """The per-layer attention of text config ``cfg``; UnsupportedModelError when a
    config attribute asks for attention the paged attention does not implement."""
    arch = architecture or architecture_name(cfg)
    _check_keys(cfg, arch)
    num_layers = int(cfg.num_hidden_layers)
    windows = _layer_windows(cfg, arch, num_layers)
    max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or _DEFAULT_MAX_POSITIONS
    return AttentionSpec(arch, windows, max_positions)


def _check_keys(cfg: Any, arch: str) -> None:
    for key, value in sorted(cfg.to_dict().items()):
        if not _ATTENTION_KEY.search(key):
            continue
        if key not in UNDERSTOOD_KEYS:
            raise UnsupportedModelError(
                arch, f"config attribute {key}={value!r} is an attention feature meshserve does not implement"
            )
        allowed = _REQUIRED_VALUES.get(key)
        if allowed is not None and value not in allowed:
            raise UnsupportedModelError(arch, f"{key}={value!r} is not supported (only {allowed})")


def _layer_windows(cfg: Any, arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None  # Qwen-style: the window is configured but switched off
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise UnsupportedModelError(arch, f"sliding_window={window!r} is not a positive int")
    types = getattr(cfg, "layer_types", None)
    if types is None:
        # Mistral, Mixtral, Phi-3, Starcoder2...: one window (or none) for every layer.
        return (window,) * num_layers
    if len(types) != num_layers:
        raise UnsupportedModelError(arch, f"layer_types has {len(types)} entries for {num_layers} layers")
    windows: list[int | None] = []
    for i, kind in enumerate(types):
        if kind not in _LAYER_TYPES:
            raise UnsupportedModelError(
                arch, f"layer {i} has attention type {kind!r} (served: {sorted(_LAYER_TYPES)})"
            )
        if _LAYER_TYPES[kind] and window is None:
            raise UnsupportedModelError(arch, f"layer {i} is sliding_attention but sliding_window is unset")
        windows.append(window if _LAYER_TYPES[kind] else None)
    return tuple(windows)
