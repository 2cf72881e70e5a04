#!/usr/bin/env bash
# Makes sure this host can build and run the images: mmdebstrap and a docker engine from the
# Debian archive (docker.io: dockerd 20.10) installed, and a docker daemon answering. Without
# systemd the daemon is started here in the background (log: /var/log/meshserve-dockerd.log).
set -euo pipefail
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v dockerd >/dev/null || need+=(docker.io)
if [ "${#need[@]}" -gt 0 ]; then
  echo "engine.sh: installing ${need[*]}"
  $SUDO apt-get install -y -q "${need[@]}" >/dev/null 2>&1 ||
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -q "${need[@]}" >/dev/null; }
fi
docker info >/dev/null 2>&1 && exit 0
echo "engine.sh: starting dockerd"
$SUDO sh -c 'nohup dockerd >/var/log/meshserve-dockerd.log 2>&1 &'
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && exit 0
  sleep 1
done
echo "engine.sh: dockerd did not answer in 60 s; see /var/log/meshserve-dockerd.log" >&2
exit 1
