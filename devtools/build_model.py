"""Build meshserve's default model: a small Llama-architecture causal LM, fully offline.

Usage::

    python -m devtools.build_model --out DIR [--steps N] [--seed S] [--tiny]

The build trains a byte-level BPE tokenizer on English text found on this machine (docstrings of
Python's standard library, plus license texts under ``/usr/share`` when present), initialises a
``LlamaForCausalLM`` and trains it briefly on the same text, part of it rendered as ChatML
dialogues, so that greedy decoding yields English-like words and chat replies end with
``<|im_end|>``. The result is a standard Hugging Face model directory (``save_pretrained``) that
``AutoModelForCausalLM`` / ``AutoTokenizer`` load without network access.

The directory is written atomically: everything goes to ``DIR.tmp`` first, which is then renamed to
``DIR``, so an interrupted build never leaves a directory with a ``config.json`` but no weights.
``--tiny`` skips training and builds a much smaller model for unit tests.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
DEFAULT_STEPS = 120
SEQ_LEN = 128
BATCH_SIZE = 16
SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

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
    steps: int
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
    parser.add_argument(
        "--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS}; 0 with --tiny)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--tiny", action="store_true", help="untrained, very small model for unit tests")
    args = parser.parse_args(argv)
    if args.tiny:
        steps = 0 if args.steps is None else args.steps
        return BuildSpec(args.out, steps, args.seed, 1000, 200_000, TINY_SHAPE)
    steps = DEFAULT_STEPS if args.steps is None else args.steps
    return BuildSpec(args.out, steps, args.seed, 4096, 1_500_000, FULL_SHAPE)


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
# Training data
# --------------------------------------------------------------------------------------------------


def _sentences(paragraph: str) -> list[str]:
    """Split a paragraph into sentences (good enough for docstring prose)."""
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph) if s]


def make_dialogues(
    corpus: Sequence[str], rng: random.Random, fraction: float = 0.35
) -> list[list[dict[str, str]]]:
    """Turn about ``fraction`` of the corpus sentences into one-turn chats (user: first half of the
    sentence, assistant: its continuation), some of them with a system prompt."""
    dialogues: list[list[dict[str, str]]] = []
    for paragraph in corpus:
        for sentence in _sentences(paragraph):
            words = sentence.split()
            if not 6 <= len(words) <= 48 or rng.random() >= fraction:
                continue
            cut = len(words) // 2
            chat = [
                {"role": "user", "content": " ".join(words[:cut])},
                {"role": "assistant", "content": " ".join(words[cut:])},
            ]
            if rng.random() < 0.3:
                chat.insert(0, {"role": "system", "content": DEFAULT_SYSTEM_PROMPT})
            dialogues.append(chat)
    return dialogues


def build_token_stream(tokenizer: PreTrainedTokenizerFast, corpus: Sequence[str], seed: int) -> torch.Tensor:
    """Tokenize plain paragraphs and ChatML dialogues, shuffled, each followed by ``<|endoftext|>``."""
    rng = random.Random(seed)
    chats = [str(tokenizer.apply_chat_template(chat, tokenize=False)) for chat in make_dialogues(corpus, rng)]
    documents = [*corpus, *chats]
    rng.shuffle(documents)
    encodings = tokenizer.backend_tokenizer.encode_batch(documents, add_special_tokens=False)
    eot = token_id(tokenizer, ENDOFTEXT)
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw ``BATCH_SIZE`` random windows of ``SEQ_LEN`` tokens from the token stream."""
    starts = torch.randint(0, len(stream) - SEQ_LEN, (BATCH_SIZE,), generator=generator)
    return torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])


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


def lr_factor(step: int, steps: int) -> float:
    """Linear warmup over the first 10% of steps, then cosine decay to 10% of the peak rate."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(model: LlamaForCausalLM, stream: torch.Tensor, steps: int, seed: int) -> float:
    """Train with AdamW on next-token prediction; return the mean loss of the last 10 steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
    generator = torch.Generator().manual_seed(seed)
    log_every = max(1, steps // 10)
    losses: list[float] = []
    model.train()
    start = time.monotonic()
    for step in range(steps):
        batch = sample_batch(stream, generator)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.item()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            elapsed = time.monotonic() - start
            print(f"  step {step + 1:4d}/{steps}  loss {recent:.3f}  ({elapsed:.1f}s)", flush=True)
    model.eval()
    tail = losses[-10:]
    return sum(tail) / len(tail) if tail else float("nan")


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


def write_atomically(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, info: dict[str, object]
) -> None:
    """Save into ``OUT.tmp`` and rename it to ``OUT`` only once it is complete."""
    out = out.absolute()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_model(model, tokenizer, tmp, info)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def cpu_count() -> int:
    """Number of CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def build(spec: BuildSpec) -> float:
    """Run the whole build described by ``spec``; return the final training loss (NaN if untrained)."""
    start = time.monotonic()
    torch.set_num_threads(cpu_count())
    corpus = collect_corpus(spec.corpus_chars)
    print(f"corpus: {len(corpus)} paragraphs, {sum(map(len, corpus))} chars", flush=True)
    tokenizer = train_tokenizer(corpus, spec.vocab_size)
    print(f"tokenizer: vocab {len(tokenizer)} ({time.monotonic() - start:.1f}s)", flush=True)
    model = make_model(tokenizer, spec.shape, spec.seed)
    loss = float("nan")
    if spec.steps > 0:
        stream = build_token_stream(tokenizer, corpus, spec.seed)
        params = sum(p.numel() for p in model.parameters())
        print(f"training: {params / 1e6:.2f}M params, {len(stream)} tokens, {spec.steps} steps", flush=True)
        loss = train(model, stream, spec.steps, spec.seed)
    final_loss = None if math.isnan(loss) else round(loss, 4)
    info: dict[str, object] = {"seed": spec.seed, "steps": spec.steps, "final_loss": final_loss}
    info["corpus_chars"] = sum(map(len, corpus))
    write_atomically(model, tokenizer, spec.out, info)
    print(f"wrote {spec.out} in {time.monotonic() - start:.1f}s (final loss {loss:.3f})", flush=True)
    return loss


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    build(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
