#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, then the training demo. It trains the tiny model
# on the built-in synthetic long-context tasks with 2 gloo ranks, first the baseline (sequential
# batching, fixed gamma) then SparseBalance (SAB + DST) on the same samples, and prints the
# comparison; report and plots land in runs/demo/. Extra flags go to `sparsebalance train`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh" "plot"
cd "$root"
exec sparsebalance train --demo --out runs/demo "$@"
