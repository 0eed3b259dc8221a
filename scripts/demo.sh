#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, then the training demo. It trains the tiny model
# on the built-in synthetic long-context tasks with 2 gloo ranks and a capacity of 2,100 tokens
# (5 documents are longer, the longest about 2x), first the baseline (sequential batching, a fixed budget,
# long documents cut into chunks) then SparseBalance (SAB + CP + DST: long documents trained whole
# over context-parallel units of ranks) on the same samples, and prints the comparison and which
# documents ran over how many ranks; report and plots land in runs/demo/. Extra flags go to
# `sparsebalance train`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh" "plot"
cd "$root"
exec sparsebalance train --demo --out runs/demo "$@"
