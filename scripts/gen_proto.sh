#!/usr/bin/env bash
# Generates Python stubs for proto/meshserve/v1/*.proto into ./meshserve/v1 (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
rm -rf meshserve
mkdir -p meshserve/v1
"$PY" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/meshserve/v1/*.proto
printf '"""Generated protobuf stubs (make proto). Do not edit."""\n' > meshserve/__init__.py
printf '"""Generated meshserve.v1 stubs."""\n' > meshserve/v1/__init__.py
