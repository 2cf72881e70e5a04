"""Build a tiny LLaVA-style vision-language model for tests, fully offline.

Usage::

    python -m devtools.build_vlm --out DIR [--seed S] [--image-size 32] [--patch-size 8]
        [--vision-hidden 32 --vision-layers 2 --text-hidden 64 --text-layers 2]

The model is a standard ``LlavaForConditionalGeneration`` (CLIP vision tower + two-layer MLP
projector + Llama text model) with random weights, saved with ``save_pretrained`` together with
everything a real LLaVA-1.5 directory ships:

* a byte-level BPE tokenizer trained on local English text (the approach of
  :mod:`devtools.build_model`) with an ``<image>`` special token, whose id is the config's
  ``image_token_index``;
* the ChatML chat template of :mod:`devtools.build_model`, which emits ``<image>`` for every
  image content part;
* ``config.json`` with ``image_seq_length`` = (image_size / patch_size)² (the CLS feature is
  dropped: ``vision_feature_select_strategy="default"``);
* ``preprocessor_config.json`` (``CLIPImageProcessor``: resize shortest edge, center crop, rescale,
  CLIP mean/std normalisation) and ``processor_config.json`` (``LlavaProcessor``).

The serving code does not know this model is tiny: it is the same code a user points at a real
LLaVA directory. The directory is written atomically (``DIR.tmp`` renamed to ``DIR``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerFast,
)

from devtools.build_model import (
    ENDOFTEXT,
    IM_END,
    collect_corpus,
    token_id,
    train_tokenizer,
    write_dir_atomically,
)

IMAGE_TOKEN = "<image>"
# OpenAI CLIP normalisation (what LLaVA-1.5's CLIPImageProcessor uses).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CORPUS_CHARS = 60_000
VOCAB_SIZE = 512


@dataclass(frozen=True)
class VlmSpec:
    """What determines a build's output."""

    out: Path
    seed: int
    image_size: int
    patch_size: int
    # Standard deviation of the random weights: larger than HF's 0.02 default so that greedy
    # decoding has clear argmax margins (token-for-token comparisons stay stable).
    init_std: float
    # Widths and depths (defaults: the tiny test model; larger for benchmarks).
    vision_hidden: int = 32
    vision_layers: int = 2
    text_hidden: int = 64
    text_layers: int = 2

    @property
    def image_seq_length(self) -> int:
        """Image features per image: one per patch (the CLS feature is dropped)."""
        return (self.image_size // self.patch_size) ** 2


def parse_args(argv: Sequence[str] | None = None) -> VlmSpec:
    """Parse the command line into a :class:`VlmSpec`."""
    parser = argparse.ArgumentParser(prog="python -m devtools.build_vlm", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--image-size", type=int, default=32, help="vision tower input size (default 32)")
    parser.add_argument("--patch-size", type=int, default=8, help="vision patch size (default 8)")
    parser.add_argument("--init-std", type=float, default=0.1, help="weight init std (default 0.1)")
    for name, default in (
        ("vision-hidden", 32),
        ("vision-layers", 2),
        ("text-hidden", 64),
        ("text-layers", 2),
    ):
        parser.add_argument(f"--{name}", type=int, default=default, help=f"(default {default})")
    args = parser.parse_args(argv)
    if args.image_size <= 0 or args.patch_size <= 0 or args.image_size % args.patch_size:
        parser.error("--image-size must be a positive multiple of --patch-size")
    if args.vision_hidden % 16 or args.text_hidden % 16:
        parser.error("--vision-hidden and --text-hidden must be multiples of 16 (16-wide heads)")
    return VlmSpec(
        args.out,
        args.seed,
        args.image_size,
        args.patch_size,
        args.init_std,
        args.vision_hidden,
        args.vision_layers,
        args.text_hidden,
        args.text_layers,
    )


def build_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """A small BPE tokenizer (devtools.build_model's recipe) plus the ``<image>`` special token."""
    del seed  # the BPE trainer is deterministic for a given corpus
    tokenizer = train_tokenizer(collect_corpus(CORPUS_CHARS), VOCAB_SIZE)
    tokenizer.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]}, replace_extra_special_tokens=False)
    return tokenizer


def make_config(tokenizer: PreTrainedTokenizerFast, spec: VlmSpec) -> LlavaConfig:
    """LLaVA config: a CLIP vision tower and a Llama text model (16-wide attention heads)."""
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=2 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_hidden // 16,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        projection_dim=spec.vision_hidden,
        initializer_range=spec.init_std,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=2 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_hidden // 16,
        num_key_value_heads=max(spec.text_hidden // 32, 1),
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=spec.init_std,
        bos_token_id=token_id(tokenizer, ENDOFTEXT),
        eos_token_id=token_id(tokenizer, IM_END),
        pad_token_id=token_id(tokenizer, ENDOFTEXT),
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=token_id(tokenizer, IMAGE_TOKEN),
        image_seq_length=spec.image_seq_length,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        dtype="float32",
    )


def make_model(
    config: LlavaConfig, tokenizer: PreTrainedTokenizerFast, seed: int
) -> LlavaForConditionalGeneration:
    """A randomly initialised float32 LLaVA model with ChatML stop tokens."""
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        eos_token_id=[token_id(tokenizer, IM_END), token_id(tokenizer, ENDOFTEXT)],
        pad_token_id=config.text_config.pad_token_id,
    )
    return model


def processor_files(spec: VlmSpec) -> dict[str, dict[str, object]]:
    """``preprocessor_config.json`` and ``processor_config.json`` as LLaVA-1.5 ships them."""
    preprocessor: dict[str, object] = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": spec.image_size},
        "resample": 3,  # PIL bicubic
        "do_center_crop": True,
        "crop_size": {"height": spec.image_size, "width": spec.image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "do_convert_rgb": True,
    }
    processor: dict[str, object] = {
        "processor_class": "LlavaProcessor",
        "image_token": IMAGE_TOKEN,
        "patch_size": spec.patch_size,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
    }
    return {"preprocessor_config.json": preprocessor, "processor_config.json": processor}


def save(
    model: LlavaForConditionalGeneration, tokenizer: PreTrainedTokenizerFast, spec: VlmSpec, directory: Path
) -> None:
    """Write the model directory: weights, configs, tokenizer, processor files, build info."""
    directory.mkdir()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory, save_jinja_files=False)
    for name, content in processor_files(spec).items():
        (directory / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    info = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(spec).items()}
    (directory / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def build(spec: VlmSpec) -> None:
    """Run the whole build described by ``spec``."""
    start = time.monotonic()
    tokenizer = build_tokenizer(spec.seed)
    config = make_config(tokenizer, spec)
    model = make_model(config, tokenizer, spec.seed)
    write_dir_atomically(spec.out, lambda tmp: save(model, tokenizer, spec, tmp))
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {spec.out}: {params / 1e6:.2f}M params in {time.monotonic() - start:.1f}s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    build(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
