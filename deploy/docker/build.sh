#!/usr/bin/env bash
# Builds meshserve's image with nothing but the package registries: the Debian archive
# (base.sh) and the Python package index pip is configured with (pip download).
#
#   deploy/docker/build.sh [cpu|cuda]        -> meshserve:VERSION (cpu) / meshserve:VERSION-cuda
#
# Steps: the base image (base.sh, the same for both flavours), the wheels of requirements.txt
# into .cache/docker/wheels-FLAVOR (`pip download`; for cuda the package index's plain Linux
# wheel of the torch pin, which is the CUDA build, with the CUDA runtime and Triton it
# requires; TORCH_INDEX_URL, when set, is the index that wheel comes from), the default model
# (`make model`'s MODEL_DIR, hard-linked into build/docker/models; BUILD_DEFAULT_MODEL=0
# stages none), then `docker build -f deploy/docker/Dockerfile` on the repository root.
# Env: PYTHON (pip's interpreter, default .venv/bin/python), IMAGE (default meshserve),
# VERSION (default: the chart's appVersion), MODEL_DIR, BUILD_DEFAULT_MODEL.
set -euo pipefail
cd "$(dirname "$0")/../.."

FLAVOR="${1:-cpu}"
case "$FLAVOR" in
  cpu) suffix="" ;;
  cuda) suffix="-cuda" ;;
  *) echo "build.sh: unknown flavor $FLAVOR (cpu | cuda)" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-.venv/bin/python}"
IMAGE="${IMAGE:-meshserve}"
VERSION="${VERSION:-$(sed -nE 's/^appVersion: *"?([^"]+)"?/\1/p' deploy/helm/meshserve/Chart.yaml)}"
MODEL_DIR="${MODEL_DIR:-.cache/models/smollm2-135m-instruct}"
BUILD_DEFAULT_MODEL="${BUILD_DEFAULT_MODEL:-1}"
STAGE=build/docker
# Downloads are kept per flavour outside the build context; the build's own flavour is
# hard-linked into it (the context would otherwise carry the other flavour's GBs of wheels).
WHEELS=".cache/docker/wheels-$FLAVOR"

deploy/docker/base.sh python
base_image="$(deploy/docker/base.sh --name python)"

mkdir -p "$WHEELS" "$STAGE"
torch_pin="$(grep -E '^torch==' requirements.txt)"
requirements=requirements.txt
if [ "$FLAVOR" = cuda ]; then
  # No pip configuration for torch itself: a find-links folder may serve the CPU build,
  # whose local label (+cpu) sorts above the plain version pip would otherwise pick.
  rm -f "$WHEELS"/torch-*+cpu*.whl
  ls "$WHEELS"/torch-"${torch_pin#torch==}"-*.whl >/dev/null 2>&1 ||
    env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip download -q --no-deps \
      ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} -d "$WHEELS" "$torch_pin"
  # The other requirements, and the CUDA runtime and Triton that wheel requires, resolve
  # against the wheel file itself.
  cuda_wheel="$(ls "$WHEELS"/torch-"${torch_pin#torch==}"-*.whl | head -1)"
  requirements="$STAGE/requirements-cuda.txt"
  sed "s|^torch==.*|$PWD/$cuda_wheel|" requirements.txt >"$requirements"
fi
"$PYTHON" -m pip download -q --find-links "$WHEELS" -d "$WHEELS" -r "$requirements"

# The flavour's torch build, checked before a long docker build would find it out.
torch_wheel="$(ls "$WHEELS"/torch-"${torch_pin#torch==}"*.whl 2>/dev/null | head -1)"
case "$FLAVOR:$torch_wheel" in
  *:) echo "build.sh: no $torch_pin wheel in $WHEELS" >&2; exit 1 ;;
  cuda:*+cpu*) echo "build.sh: $WHEELS holds a CPU torch ($(basename "$torch_wheel")); remove it, or set TORCH_INDEX_URL to an index serving the CUDA $torch_pin" >&2; exit 1 ;;
esac

# pip evaluates environment markers with the interpreter it runs on, not the image's
# (e.g. redis needs async-timeout on python < 3.11.3 only): resolve the requirements with the
# image's own pip, offline, and download whatever it finds missing, until nothing is.
for _ in 1 2 3 4 5 6 7 8; do
  missing="$(docker run --rm --network none -v "$PWD/$WHEELS:/wheels:ro" -v "$PWD/requirements.txt:/r.txt:ro" \
    "$base_image" sh -c 'python3.11 -m venv /tmp/v && /tmp/v/bin/pip install -q --dry-run --no-index --find-links /wheels -r /r.txt' 2>&1 |
    sed -nE 's/.*No matching distribution found for ([^;]+).*/\1/p' | head -1 || true)"
  [ -n "$missing" ] || break
  echo "build.sh: the image's python also needs $missing"
  "$PYTHON" -m pip download -q --no-deps -d "$WHEELS" "$missing"
done

# The wheels and the model directory are hard-linked (a copy across file systems): the build
# context must hold real files, and .cache may be a symbolic link.
rm -rf "$STAGE"/wheels* "$STAGE/models"
mkdir -p "$STAGE/models"
cp -al "$WHEELS" "$STAGE/wheels" 2>/dev/null || cp -a "$WHEELS" "$STAGE/wheels"
if [ "$BUILD_DEFAULT_MODEL" = 1 ]; then
  src="$(readlink -f "$MODEL_DIR")"
  test -f "$src/config.json" || { echo "build.sh: no model at $MODEL_DIR (make model)" >&2; exit 1; }
  cp -al "$src" "$STAGE/models/$(basename "$MODEL_DIR")" 2>/dev/null || cp -a "$src" "$STAGE/models/$(basename "$MODEL_DIR")"
fi

tag="$IMAGE:$VERSION$suffix"
echo "build.sh: docker build $tag (base $base_image, wheels $WHEELS)"
started=$SECONDS
docker build -f deploy/docker/Dockerfile -t "$tag" \
  --build-arg BASE_IMAGE="$base_image" \
  --build-arg WHEELS="$STAGE/wheels" \
  --build-arg TORCH_DEVICE="$FLAVOR" \
  --build-arg MODELS="$STAGE/models" \
  .
echo "build.sh: built $tag in $((SECONDS - started)) s (docker build; $SECONDS s in all)"
