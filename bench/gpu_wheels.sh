#!/usr/bin/env bash
# Downloads into .whl/ the wheels that bench/gpu_check.sh installs on a GPU machine that has only
# PyTorch's stack (torch, transformers, numpy, pyyaml, pytest, ...) and cannot reach a registry:
# what the learner's training code and the check import beyond that, at the versions .venv runs.
# Run here, from anywhere; then hand .whl to the device run (carry [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# Python and platform of the GPU machine (x86-64, CPython 3.12).
TARGET=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pinned() { "$PY" -m pip show "$1" | sed -n 's/^Version: //p'; }
# pydantic (rlmesh.services.config) and what it imports; megatron-core (the Megatron backend; a
# CPython-specific wheel); pytest-timeout (the per-test timeout). typing-extensions is carried too:
# pydantic needs a recent one and torch's may be older.
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions megatron-core pytest-timeout)
rm -rf .whl && mkdir .whl
for name in "${PACKAGES[@]}"; do
  version=$(pinned "$name")
  [ -n "$version" ] || { echo "gpu_wheels: $name is not installed in $PY's environment (make setup)" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d .whl "$name==$version"
done
ls -l .whl
du -sh .whl
