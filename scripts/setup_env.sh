#!/usr/bin/env bash
# Create (or reuse) .venv and install SparseBalance with the extras given as "$1" (e.g. "dev,plot").
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (it only installs what is missing).
# Each step says what it installs and about how long it takes before it starts, and how long it
# took after. torch: on a machine without a GPU the CPU build from the PyTorch CPU index (the
# default index's Linux x86 wheel is the CUDA build, several GB), else the default index's.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
venv="${SPARSEBALANCE_VENV:-$root/.venv}"
torch_version="2.13.0"  # the version the test suite runs (pyproject.toml allows a range)
cpu_index="${SPARSEBALANCE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating a virtual environment in $venv (a few seconds)"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.sparsebalance-installed-$extras"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    started=$SECONDS
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
      # a machine with torch preinstalled keeps its own (scripts/gpu_check.sh: --system-site-packages)
      echo "[setup] GPU found: installing torch $torch_version, the CUDA build, from the default index" \
        "(~3 GB with its CUDA libraries: several minutes)"
      "$py" -m pip install -q "torch==$torch_version"
    else
      echo "[setup] no GPU: installing torch $torch_version, the CPU build (~200 MB: about a minute on a fast link)"
      # pip also looks where its configuration says (find-links, extra indexes): say where it took it from
      if log="$("$py" -m pip install "torch==$torch_version" --index-url "$cpu_index" --timeout 30 --retries 1 2>&1)"; then
        got="$(printf '%s\n' "$log" | grep -oE '(Downloading|Processing|Using cached) [^ ]*torch-[^ ]*' | head -n 1 || true)"
        host="${cpu_index#*://}"
        case "$got" in
          *"${host%%/*}"*) where="the PyTorch CPU index ($cpu_index)" ;;
          "") where="what was already downloaded" ;;
          *) where="${got#* } (pip's configured sources; the CPU index was asked first)" ;;
        esac
        echo "[setup] torch: the CPU build from $where"
      else
        echo "[setup] the PyTorch CPU index ($cpu_index) gave no torch $torch_version: installing from the" \
          "default index instead (on Linux x86 that is the CUDA build, several GB: minutes)"
        "$py" -m pip install -q "torch==$torch_version"
      fi
    fi
    echo "[setup] torch installed in $((SECONDS - started)) s"
  fi
  started=$SECONDS
  spec="$root"
  [ -n "$extras" ] && spec="$root[$extras]"
  echo "[setup] installing sparsebalance${extras:+[$extras]} and its dependencies (transformers, numpy," \
    "safetensors, the Qwen tokenizer${extras:+, the $extras extras}): about 1-3 minutes the first time"
  "$py" -m pip install -q -e "$spec"
  echo "[setup] sparsebalance installed in $((SECONDS - started)) s; in a new shell: source $venv/bin/activate"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
