"""The architecture matrix: tiny random configs of every causal LM family meshserve serves.

``tests/worker_engine/test_arch_matrix.py`` builds each case at test time (no downloads)
and checks the engine token for token against transformers' greedy ``generate``;
``devtools/readme_arch_table.py`` renders the same list as the README's table of
supported architectures, so the two cannot drift.

Every case is as small as its architecture allows: hidden 32, 4 heads / 2 KV heads,
2 layers (a windowed family gets one sliding and one full layer where it interleaves),
vocab 128 and a sliding window of :data:`WINDOW` tokens, far shorter than the prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CASES", "UNSUPPORTED", "WINDOW", "ArchCase", "build_config"]

WINDOW = 8
VOCAB = 128

# Every family's tiny config: the vocabulary, and no BOS/EOS token.
_ANY_FAMILY: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": None, "eos_token_id": None}
# The sizes under the names most families give them.
_SIZES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}
# A wider init than 0.02 gives peaked logits: greedy near-ties (float-noise flips
# between two correct implementations) become vanishingly unlikely.
_INIT = 0.1
# Shared by the Llama-like configs; the others spell their sizes their own way.
_COMMON: dict[str, Any] = {
    **_ANY_FAMILY,
    **_SIZES,
    "num_key_value_heads": 2,
    "initializer_range": _INIT,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
_INTERLEAVED = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}


@dataclass(frozen=True)
class ArchCase:
    """One architecture of the matrix: its config class and the overrides of its tiny config."""

    name: str  # the README's name for the family
    config_class: str  # transformers config class
    architecture: str  # the causal LM class AutoModelForCausalLM builds
    overrides: dict[str, Any] = field(default_factory=dict)
    common: bool = True  # start from the Llama-like keys of _COMMON (else from _ANY_FAMILY)
    features: str = "causal"  # what the case exercises, for the README

    def config_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the tiny config."""
        return {**(_COMMON if self.common else _ANY_FAMILY), **self.overrides}


CASES: tuple[ArchCase, ...] = (
    ArchCase("Llama", "LlamaConfig", "LlamaForCausalLM"),
    ArchCase(
        "Mistral",
        "MistralConfig",
        "MistralForCausalLM",
        {"sliding_window": WINDOW},
        features="sliding window (all layers)",
    ),
    ArchCase(
        "Qwen2",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        features="sliding window above max_window_layers",
    ),
    ArchCase("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}, features="causal, QK norm"),
    ArchCase(
        "Qwen3-MoE",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        features="causal, MoE",
    ),
    ArchCase(
        "Mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_MOE, "sliding_window": WINDOW},
        features="sliding window, MoE",
    ),
    ArchCase(
        "Gemma 2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {**_INTERLEAVED, "head_dim": 8, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 0.3},
        features="interleaved sliding/full, attention logit softcapping, query_pre_attn_scalar",
    ),
    ArchCase(
        "Gemma 3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**_INTERLEAVED, "head_dim": 8, "query_pre_attn_scalar": 16},
        features="interleaved sliding/full, query_pre_attn_scalar",
    ),
    ArchCase(
        "gpt-oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        {**_INTERLEAVED, **_MOE, "head_dim": 8, "intermediate_size": 32},
        features="attention sinks, interleaved sliding/full, MoE",
    ),
    ArchCase(
        "Phi-3",
        "Phi3Config",
        "Phi3ForCausalLM",
        {"sliding_window": WINDOW},
        features="sliding window (all layers)",
    ),
    ArchCase(
        "Starcoder2",
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        {"sliding_window": WINDOW},
        features="sliding window (all layers)",
    ),
    ArchCase("OLMo-2", "Olmo2Config", "Olmo2ForCausalLM", features="causal, QK norm"),
    ArchCase(
        "Granite",
        "GraniteConfig",
        "GraniteForCausalLM",
        {"attention_multiplier": 0.3},
        features="causal, attention_multiplier",
    ),
    ArchCase("Cohere", "CohereConfig", "CohereForCausalLM"),
    ArchCase("Gemma", "GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    ArchCase(
        "GPT-2",
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256, "initializer_range": _INIT},
        common=False,
        features="causal, learned positions",
    ),
    ArchCase(
        "GPT-NeoX",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {**_SIZES, "initializer_range": _INIT},
        common=False,
        features="causal, partial rotary",
    ),
    ArchCase(
        "OPT",
        "OPTConfig",
        "OPTForCausalLM",
        {
            "hidden_size": 32,
            "ffn_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "word_embed_proj_dim": 32,
            "max_position_embeddings": 256,
            "init_std": _INIT,
            "pad_token_id": 1,
        },
        common=False,
        features="causal, learned positions",
    ),
)

# Architectures refused at load, with a phrase the error must contain.
UNSUPPORTED: tuple[tuple[ArchCase, str], ...] = (
    (
        ArchCase(
            "Falcon",
            "FalconConfig",
            "FalconForCausalLM",
            {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4},
            common=False,
        ),
        "does not route attention through transformers' AttentionInterface",
    ),
    (
        ArchCase(
            "Gemma 3 (bidirectional)",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            {**_INTERLEAVED, "head_dim": 8, "use_bidirectional_attention": True},
        ),
        "use_bidirectional_attention=True",
    ),
    (
        ArchCase("Llama (chunked attention)", "LlamaConfig", "LlamaForCausalLM", {"attention_chunk_size": 8}),
        "attention_chunk_size=8",
    ),
)


def build_config(case: ArchCase) -> Any:
    """The tiny transformers config of ``case`` (its ``architectures`` set, as a checkpoint's)."""
    import transformers

    config_cls = getattr(transformers, case.config_class)
    config = config_cls(**case.config_kwargs())
    config.architectures = [case.architecture]
    return config
