#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, then run the demo.
# Until the trainer lands, the demo is the attention benchmark (quick grid): block-sparse
# attention forward+backward against dense causal SDPA at several densities.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh" "plot"
cd "$root"
exec sparsebalance bench-attn --quick "$@"
