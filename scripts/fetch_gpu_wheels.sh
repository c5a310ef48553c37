#!/usr/bin/env bash
# Download into .whl/ the wheels the GPU host lacks (it has torch, pyyaml, pillow, tensorboard and no
# network): megatron-core, the version CI tests, built for that host's CPython 3.12 on x86-64.
set -euo pipefail
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl "megatron-core==0.16.1"
ls .whl
