"""`python -m worker_svc --model-dir DIR --role decoder|embedding|encoder --scheduler-address ...`"""

from __future__ import annotations

import sys

from services.config import load_config
from services.server import run_service
from worker_svc.config import WorkerConfig
from worker_svc.main import main

if __name__ == "__main__":
    parsed = load_config(WorkerConfig, sys.argv[1:], prog="worker_svc")
    run_service(lambda: main(parsed), parsed)
