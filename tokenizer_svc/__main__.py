"""`python -m tokenizer_svc --model-dir DIR [--port PORT ...]` (flags or MESHSERVE_* env)."""

from __future__ import annotations

import sys

from services.config import load_config
from services.server import run_service
from tokenizer_svc.config import TokenizerConfig
from tokenizer_svc.server import main

if __name__ == "__main__":
    parsed = load_config(TokenizerConfig, sys.argv[1:], prog="python -m tokenizer_svc")
    run_service(lambda: main(parsed), parsed)
