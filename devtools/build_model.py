"""Build the random-weight test models: a Llama-architecture causal LM in seconds, fully offline.

Usage::

    python -m devtools.build_model --out DIR [--seed S] [--tiny]

The build trains a byte-level BPE tokenizer on English text found on this machine (docstrings of
Python's standard library, plus license texts under ``/usr/share`` when present) and initialises a
``LlamaForCausalLM`` with random weights sized for it. Its greedy output is deterministic noise: tests
compare it token for token with transformers' own ``generate``; what a real model answers is tested on
the default model (:mod:`devtools.default_model`). The result is a standard Hugging Face model
directory (``save_pretrained``) with a ChatML chat template (tools, multimodal parts, tool calls).

The directory is written atomically: everything goes to ``DIR.tmp`` first, which is then renamed to
``DIR``, so an interrupted build never leaves a directory with a ``config.json`` but no weights.
``--tiny`` builds a much smaller model (64 hidden, 2 layers, vocab 1000).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})

# ChatML with tools, multimodal content parts and assistant tool calls. Only standard Jinja and the
# `tojson` filter, so it renders in transformers' sandboxed `apply_chat_template`. Every output goes
# through `{{- ... }}` and every tag trims whitespace, so the layout below never leaks into prompts.
CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is mapping -%}
    {{- content | tojson -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}
      {%- if part is string -%}
        {{- part -}}
      {%- elif part['type'] == 'text' -%}
        {{- part['text'] -}}
      {%- elif part['type'] in ['image', 'image_url'] -%}
        {{- '<image>' -}}
      {%- elif part['type'] in ['audio', 'input_audio'] -%}
        {{- '<audio>' -}}
      {%- elif part['type'] in ['video', 'video_url'] -%}
        {{- '<video>' -}}
      {%- else -%}
        {{- '<' ~ part['type'] ~ '>' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro render_tool_call(tool_call) -%}
  {%- set fn = tool_call['function'] if tool_call['function'] is defined else tool_call -%}
  {%- set args = fn['arguments'] if fn['arguments'] is defined else {} -%}
  {{- '<tool_call>\n{"name": ' ~ (fn['name'] | tojson) ~ ', "arguments": ' -}}
  {%- if args is string -%}
    {{- args -}}
  {%- else -%}
    {{- args | tojson -}}
  {%- endif -%}
  {{- '}\n</tool_call>' -}}
{%- endmacro -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system_message = render_content(messages[0]['content']) -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set system_message = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if system_message -%}
    {{- system_message ~ '\n\n' -}}
  {%- endif -%}
  {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\n' ~ (tool | tojson) -}}
  {%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
  {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif system_message -%}
  {{- '<|im_start|>system\n' ~ system_message ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- set content = render_content(message['content']) -%}
  {%- if message['role'] == 'assistant' -%}
    {{- '<|im_start|>assistant\n' ~ content -}}
    {%- if message['tool_calls'] is defined and message['tool_calls'] -%}
      {%- for tool_call in message['tool_calls'] -%}
        {%- if content or not loop.first -%}
          {{- '\n' -}}
        {%- endif -%}
        {{- render_tool_call(tool_call) -}}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message['role'] == 'tool' -%}
    {{- '<|im_start|>tool\n<tool_response>\n' ~ content ~ '\n</tool_response><|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' ~ message['role'] ~ '\n' ~ content ~ '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()


@dataclass(frozen=True)
class ModelShape:
    """Architecture hyper-parameters of the Llama model (vocab size comes from the tokenizer)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


@dataclass(frozen=True)
class BuildSpec:
    """Everything that determines a build's output."""

    out: Path
    seed: int
    vocab_size: int
    corpus_chars: int
    shape: ModelShape


FULL_SHAPE = ModelShape(256, 688, 4, 8, 4)
TINY_SHAPE = ModelShape(64, 128, 2, 4, 2)


def parse_args(argv: Sequence[str] | None = None) -> BuildSpec:
    """Parse the command line into a :class:`BuildSpec`."""
    parser = argparse.ArgumentParser(
        prog="python -m devtools.build_model", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    parser.add_argument("--tiny", action="store_true", help="a much smaller model (64 hidden, 2 layers)")
    args = parser.parse_args(argv)
    if args.tiny:
        return BuildSpec(args.out, args.seed, 1000, 200_000, TINY_SHAPE)
    return BuildSpec(args.out, args.seed, 4096, 1_500_000, FULL_SHAPE)


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------


def _stdlib_files() -> list[Path]:
    """Python source files of the standard library, excluding third-party packages and test suites."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIPPED_STDLIB_DIRS & set(p.relative_to(root).parts)]
    return sorted(files)


def _docstrings(path: Path) -> Iterator[str]:
    """Yield the module, class and function docstrings of one Python file (nothing if unparsable)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def _text_files() -> Iterator[Path]:
    """License and copyright texts that Debian-like systems ship; absent paths are simply skipped."""
    share = Path("/usr/share")
    yield from sorted((share / "common-licenses").glob("*"))
    yield from sorted((share / "doc").glob("*/copyright"))


def _builtin_docs() -> Iterator[str]:
    """Docstrings of the interpreter's built-in modules and their members (needs no source files)."""
    for name in sorted(sys.builtin_module_names):
        module = importlib.import_module(name)
        for obj in (module, *(getattr(module, attr) for attr in sorted(dir(module)))):
            doc = inspect.getdoc(obj)
            if doc:
                yield doc


def raw_texts() -> Iterator[str]:
    """Yield English source texts in a fixed order: stdlib docstrings, system licenses, and finally
    the docstrings of built-in modules (a fallback for installations without stdlib sources)."""
    for path in _stdlib_files():
        yield from _docstrings(path)
    for path in _text_files():
        try:
            if path.is_file():
                yield path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
    yield from _builtin_docs()


def clean_paragraphs(text: str) -> Iterator[str]:
    """Split ``text`` on blank lines and yield the paragraphs that read like English prose."""
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines()]
        if any(line.startswith((">>>", "...", "$ ", "|", "+-", "==", "--")) for line in lines):
            continue
        para = " ".join(" ".join(lines).split())
        if len(para.split()) < 5 or len(para) > 2000:
            continue
        prose = sum(ch.isalpha() or ch in " ,.;:'()-" for ch in para)
        if prose / len(para) >= 0.9:
            yield para


def collect_corpus(max_chars: int) -> list[str]:
    """Collect de-duplicated English paragraphs from local sources, up to ``max_chars`` characters."""
    seen: set[str] = set()
    corpus: list[str] = []
    total = 0
    for text in raw_texts():
        for para in clean_paragraphs(text):
            if para in seen:
                continue
            seen.add(para)
            corpus.append(para)
            total += len(para)
            if total >= max_chars:
                return corpus
    if not corpus:
        raise RuntimeError("no local English text found to train on")
    return corpus


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def train_tokenizer(corpus: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it as a chat-ready ``PreTrainedTokenizerFast``."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    if [backend.token_to_id(token) for token in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens {SPECIAL_TOKENS} must get ids 0..{len(SPECIAL_TOKENS) - 1}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The id of ``token`` in ``tokenizer``'s vocabulary."""
    index = tokenizer.backend_tokenizer.token_to_id(token)
    if index is None:
        raise KeyError(token)
    return int(index)


def make_model(tokenizer: PreTrainedTokenizerFast, shape: ModelShape, seed: int) -> LlamaForCausalLM:
    """Create a randomly initialised float32 Llama model sized for ``tokenizer``."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        dtype="float32",
        bos_token_id=token_id(tokenizer, ENDOFTEXT),
        eos_token_id=token_id(tokenizer, IM_END),
        pad_token_id=token_id(tokenizer, ENDOFTEXT),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[token_id(tokenizer, IM_END), token_id(tokenizer, ENDOFTEXT)],
        pad_token_id=config.pad_token_id,
    )
    return model


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def save_model(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, directory: Path, info: dict[str, object]
) -> None:
    """Write the Hugging Face model directory (weights, configs, tokenizer) plus build metadata."""
    directory.mkdir(parents=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory, save_jinja_files=False)  # chat_template in tokenizer_config.json
    (directory / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory ``src`` to ``dst``, replacing any previous build."""
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        dst.rename(old)
        src.rename(dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        src.rename(dst)


def write_dir_atomically(out: Path, write: Callable[[Path], None]) -> None:
    """Have ``write`` create and fill ``OUT.tmp``, then rename it to ``OUT`` only once it is
    complete: a failed build leaves the previous one (and no ``OUT.tmp``) behind."""
    out = out.absolute()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_atomically(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, info: dict[str, object]
) -> None:
    """Save into ``OUT.tmp`` and rename it to ``OUT`` only once it is complete."""
    write_dir_atomically(out, lambda tmp: save_model(model, tokenizer, tmp, info))


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def cpu_count() -> int:
    """Number of CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def build(spec: BuildSpec) -> None:
    """Run the whole build described by ``spec``."""
    start = time.monotonic()
    torch.set_num_threads(cpu_count())
    corpus = collect_corpus(spec.corpus_chars)
    tokenizer = train_tokenizer(corpus, spec.vocab_size)
    model = make_model(tokenizer, spec.shape, spec.seed)
    info: dict[str, object] = {"seed": spec.seed, "corpus_chars": sum(map(len, corpus)), "weights": "random"}
    write_atomically(model, tokenizer, spec.out, info)
    print(f"wrote {spec.out} in {time.monotonic() - start:.1f}s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    build(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
