#!/usr/bin/env bash
# Create (or reuse) .venv and install SparseBalance with the extras given as "$1" (e.g. "dev,plot").
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (it only installs what is missing).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
venv="${SPARSEBALANCE_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment in $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.sparsebalance-installed-$extras"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
      # The version the test suite runs on CPU, as a CUDA build (PyPI's default wheel); a
      # machine with torch preinstalled keeps its own (scripts/gpu_check.sh: --system-site-packages).
      echo "[setup] CUDA found: installing torch 2.13.0 (CUDA build)"
      "$py" -m pip install -q "torch==2.13.0"
    else
      # CPU-only machine: the CPU wheel (a local file here; the CPU index elsewhere).
      echo "[setup] no CUDA: installing the CPU build of torch"
      "$py" -m pip install -q torch==2.13.0 \
        || "$py" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    fi
  fi
  spec="$root"
  [ -n "$extras" ] && spec="$root[$extras]"
  echo "[setup] installing sparsebalance${extras:+[$extras]}"
  "$py" -m pip install -q -e "$spec"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
