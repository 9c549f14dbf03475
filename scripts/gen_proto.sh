#!/usr/bin/env bash
# Regenerates the Python code for proto/rlmesh/v1/*.proto. The output is committed; never edit it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
"$PY" -m grpc_tools.protoc -I proto \
  --python_out=proto --grpc_python_out=proto --pyi_out=proto \
  proto/rlmesh/v1/*.proto
