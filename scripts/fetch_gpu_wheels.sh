#!/usr/bin/env bash
# Download into .whl/ (ignored by git) the wheels of scripts/gpu_wheels.txt, built for the GPU
# host's CPython 3.12 on x86-64: what it lacks, as it has no network. scripts/gpu_truth.sh
# --preflight runs this when one is missing, and checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl -r scripts/gpu_wheels.txt
ls .whl
