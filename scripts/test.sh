#!/usr/bin/env bash
# The test suite on a fresh machine: set up .venv with the dev extras, then run pytest.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m slow` or `scripts/test.sh -m distributed`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh" "dev,plot,eval,hf"
cd "$root"
exec python -m pytest "$@"
