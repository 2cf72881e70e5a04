"""`python -m worker_svc --model-dir DIR --role decoder|embedding|encoder --scheduler-address ...`"""

from __future__ import annotations

import os
import sys


def _run() -> None:
    # libgomp reads this once, when torch loads it, so it is set before the first import
    # of torch. PASSIVE: the engine's OpenMP threads sleep at the end of a parallel region
    # instead of spinning (libgomp's default spins 300k iterations, holding a core after
    # every op). On a host the worker shares with the gateway (make serve, a CPU node)
    # that spinning took the core the gateway needs to pass the token on: c=1 TTFT
    # through the mesh -1.5 ms, c=32 throughput unchanged (bench/README, "Session 15").
    # An OMP_WAIT_POLICY already in the environment wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from services.server import run_service
    from worker_svc.main import main

    run_service(lambda: main(sys.argv[1:]))


if __name__ == "__main__":
    _run()
