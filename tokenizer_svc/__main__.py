"""`python -m tokenizer_svc --model-dir DIR [--port PORT ...]` (flags or MESHSERVE_* env)."""

from __future__ import annotations

import sys

from services.server import run_service
from tokenizer_svc.server import main

if __name__ == "__main__":
    run_service(lambda: main(sys.argv[1:]))
