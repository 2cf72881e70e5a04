#!/usr/bin/env bash
# Sourced by bench/gpu/run.sh on the GPU host, in the repo's root: puts
# the carried wheels (.gpu-kit/wheels) on PYTHONPATH and redis-server (.gpu-kit/debs) on PATH.
# Both land under /tmp, where a later call to the same (warm) machine finds them set up.
KIT=${KIT:-.gpu-kit}
PY=${PY:-python3}
SITE=/tmp/meshserve-gpu-site
REDIS_ROOT=/tmp/meshserve-redis

if [ ! -f "$SITE/.installed" ]; then
  for need in "$KIT/wheels" "$KIT/debs" meshserve/v1/worker_pb2.py; do
    [ -e "$need" ] || { echo "env.sh: $need missing: run bench/gpu/prepare.sh and carry .gpu-kit and meshserve"; return 2; }
  done
  # The host's python3 lives in a venv of its own (torch, CUDA): a venv made from it would not
  # see its packages, so the carried wheels go to a folder on PYTHONPATH, ahead of the host's
  # (grpcio and protobuf at the versions our stubs were generated with).
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/wheels/*.whl \
    || { echo "env.sh: wheel install failed"; return 3; }
  # redis-server from its Debian package, with its own libraries only for itself.
  for deb in "$KIT"/debs/*.deb; do dpkg -x "$deb" "$REDIS_ROOT"; done
  mkdir -p "$REDIS_ROOT/bin"
  cat >"$REDIS_ROOT/bin/redis-server" <<SCRIPT
#!/bin/sh
LD_LIBRARY_PATH=$REDIS_ROOT/usr/lib/x86_64-linux-gnu exec $REDIS_ROOT/usr/bin/redis-server "\$@"
SCRIPT
  chmod +x "$REDIS_ROOT/bin/redis-server"
  touch "$SITE/.installed"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$REDIS_ROOT/bin:$PATH"
redis-server --version || LD_LIBRARY_PATH=$REDIS_ROOT/usr/lib/x86_64-linux-gnu ldd "$REDIS_ROOT/usr/bin/redis-check-rdb"
