"""The GPU readiness kit (bench/gpu/README in bench/README.md: prepare.sh here, run.sh there)."""
