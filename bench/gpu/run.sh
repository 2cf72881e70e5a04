#!/usr/bin/env bash
# Runs the GPU kit on a GPU host, in one command, in the root of a copy of this repo that
# carries .gpu-kit/ and meshserve/ (bench/gpu/prepare.sh makes both and prints the call).
# Installs the carried wheels, unpacks redis-server, runs `python -m bench.gpu.kit` within
# its budget and leaves bench/results/gpu.json, plus run.log and the step and service logs
# under $OUT (the device tool's return folder; bench/results/gpu_out without one).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu_out}
KIT=.gpu-kit
PY=${PYTHON:-python3}
WORK=/tmp/meshserve-gpu-kit
# The mesh's log folders (tempfile.mkdtemp) land here, so they can come back.
export TMPDIR=/tmp/meshserve-gpu-tmp
mkdir -p "$OUT" "$TMPDIR" "$WORK"
exec > >(tee -a "$OUT/run.log") 2>&1
echo "run.sh: $(date -u +%FT%TZ) on $(hostname), $(nproc) CPUs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "run.sh: no nvidia-smi"

source bench/gpu/env.sh || exit $?

"$PY" - <<'EOF' || echo "run.sh: an import failed (the kit records what it breaks)"
import fastapi, grpc, grpc_health, llguidance, opentelemetry.sdk, redis, torch, transformers, triton, uvicorn
import meshserve.v1.worker_pb2
print("run.sh: imports ok; torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "| transformers", transformers.__version__, "| triton", triton.__version__, "| grpc", grpc.__version__)
EOF

export PYTHONUNBUFFERED=1
export MESHSERVE_KIT_COMMIT=$(cat "$KIT/commit.txt" 2>/dev/null)  # bench/gpu/env_info.py
# The kit keeps its own budget (530 s) and writes the JSON after every step; this is the backstop.
# KIT_STEPS runs a subset (comma-separated, kit order) into KIT_OUT, leaving gpu.json as it is.
RESULT=${KIT_OUT:-bench/results/gpu.json}
timeout -k 10 560 "$PY" -m bench.gpu.kit --profile "${KIT_PROFILE:-gpu}" --out "$RESULT" --work "$WORK" \
  ${KIT_STEPS:+--steps "$KIT_STEPS"}
echo "run.sh: kit exit code $?"

cp "$RESULT" "$OUT/" 2>/dev/null || echo "run.sh: no $RESULT was written"
tar -czf "$OUT/logs.tar.gz" "${RESULT%.json}_logs" "$WORK"/parts "$TMPDIR"/meshserve-bench-logs-* 2>/dev/null
"$PY" -c "import json; r = json.load(open('$RESULT')); print(json.dumps({k: r[k] for k in ('env', 'summary', 'wall_s')}, indent=1)); print({n: s['status'] for n, s in r['steps'].items()})" || true
sleep 1  # lets tee write the last lines to run.log
