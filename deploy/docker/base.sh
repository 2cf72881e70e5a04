#!/usr/bin/env bash
# Builds the base images of meshserve's images from the Debian archive alone (no container
# registry): mmdebstrap makes a minimal bookworm root filesystem with pinned packages and
# `docker import` turns it into a local image.
#
#   deploy/docker/base.sh [--force] FLAVOR...
#   deploy/docker/base.sh --name FLAVOR       prints the image name only
#
# FLAVOR (one or more; default: python redis):
#   python  meshserve-base:py3.11-bookworm  Debian's python3.11 + venv, catatonit (pause), and
#                                           the toolchain the engine compiles with at start-up:
#                                           gcc/g++ and Python headers (torch.compile's C++
#                                           kernels, the native CPU kernels of
#                                           worker_svc/engine/csrc, Triton's launcher stubs).
#                                           The base of both the CPU and the CUDA image.
#   redis   meshserve-redis:7.0-bookworm    redis-server + redis-cli (the chart's Redis)
# An image that exists already is kept unless --force. MIRROR (default: the first URI of
# /etc/apt/sources.list.d/debian.sources, else deb.debian.org) names the Debian mirror.
set -euo pipefail

SUITE=bookworm
# Pinned versions (bookworm + bookworm-security); a version the mirror no longer serves
# fails the build loudly.
PY=3.11.2-6+deb12u9
PY_PKGS="python3.11=$PY,python3.11-minimal=$PY,libpython3.11-stdlib=$PY,libpython3.11-minimal=$PY"
PY_PKGS="$PY_PKGS,python3.11-venv=$PY,catatonit=0.1.7-1+b2"
TOOLCHAIN_PKGS="python3.11-dev=$PY,libpython3.11-dev=$PY,gcc=4:12.2.0-3,g++=4:12.2.0-3,libc6-dev=2.36-9+deb12u14"
REDIS=5:7.0.15-1~deb12u10
REDIS_PKGS="redis-server=$REDIS,redis-tools=$REDIS"

image_of() {
  case "$1" in
    python) echo "meshserve-base:py3.11-${SUITE}" ;;
    redis) echo "meshserve-redis:7.0-${SUITE}" ;;
    *) echo "unknown flavor: $1 (python | redis)" >&2; return 2 ;;
  esac
}

packages_of() {
  case "$1" in
    python) echo "$PY_PKGS,$TOOLCHAIN_PKGS" ;;
    redis) echo "$REDIS_PKGS" ;;
  esac
}

mirror() {
  if [ -n "${MIRROR:-}" ]; then echo "$MIRROR"; return; fi
  local uri
  uri="$(grep -hm1 -E '^URIs:' /etc/apt/sources.list.d/debian.sources 2>/dev/null | awk '{print $2}')"
  echo "${uri:-http://deb.debian.org/debian}"
}

build() {
  local flavor="$1" image pkgs main security
  image="$(image_of "$flavor")"
  if [ "$FORCE" = 0 ] && docker image inspect "$image" >/dev/null 2>&1; then
    echo "base.sh: $image exists (--force rebuilds it)"
    return
  fi
  pkgs="$(packages_of "$flavor")"
  main="$(mirror)"
  security="${main%/debian}/debian-security"
  echo "base.sh: building $image from $main ($pkgs)"
  # minbase: Essential + apt + priority required (passwd for useradd); docs, man pages and
  # locales are left out, the apt lists removed. The tarball goes through a file so that a
  # failed mmdebstrap never imports a partial root filesystem.
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  mmdebstrap --variant=minbase --include="$pkgs" \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$SUITE" "$tmp/rootfs.tar" \
    "deb $main $SUITE main" "deb $main $SUITE-updates main" "deb $security $SUITE-security main"
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --change "LABEL org.opencontainers.image.title=$image io.meshserve.packages=$pkgs" \
    "$tmp/rootfs.tar" "$image"
}

FORCE=0
NAME_ONLY=0
flavors=()
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    --name) NAME_ONLY=1 ;;
    -h | --help) sed -n '2,/^set /{/^set /!p}' "$0"; exit 0 ;;
    *) image_of "$arg" >/dev/null; flavors+=("$arg") ;;
  esac
done
[ "${#flavors[@]}" -gt 0 ] || flavors=(python redis)
if [ "$NAME_ONLY" = 1 ]; then for flavor in "${flavors[@]}"; do image_of "$flavor"; done; exit 0; fi
command -v mmdebstrap >/dev/null || { echo "base.sh: mmdebstrap missing (apt-get install mmdebstrap)" >&2; exit 1; }
for flavor in "${flavors[@]}"; do build "$flavor"; done
