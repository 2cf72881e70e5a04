"""`python -m worker_svc --model-dir DIR --role decoder|embedding|encoder --scheduler-address ...`"""

from __future__ import annotations

import sys

from services.server import run_service
from worker_svc.main import main

if __name__ == "__main__":
    run_service(lambda: main(sys.argv[1:]))
