#!/usr/bin/env bash
# The newcomer's path: a fresh clone of this repository (its committed HEAD: uncommitted changes
# are not in it), no virtual environment and an empty cache (a HOME of its own, so the demo
# measures its latency profile as on a new machine), then exactly the commands of the README's
# quick-start block (the one after "<!-- newcomer.sh runs the next block -->"), in order, each
# timed. Stops at the first command that fails, with its exit code.
#
#   bash scripts/newcomer.sh                    # in a temporary folder, removed at the end
#   bash scripts/newcomer.sh --workdir DIR      # clone into DIR/sparsebalance and keep it
#   bash scripts/newcomer.sh --keep-cache       # use this machine's ~/.cache (no fresh profile)
#   bash scripts/newcomer.sh --dry-run          # print the commands it would run, run nothing
#
# It trains the demo and runs the whole default test tier on a fresh setup: ~20 minutes alone on
# a 2-core machine; run it alone. `bash scripts/test.sh -m newcomer` runs it as a test
# (tests/docs/test_newcomer.py; not in .ci/run, which already runs the default tier).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

workdir=""
dry_run=0
fresh_home=1
while [ $# -gt 0 ]; do
  case "$1" in
    --workdir) workdir="${2:?--workdir needs a folder}"; shift ;;
    --keep-cache) fresh_home=0 ;;
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "newcomer: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# The README's quick-start block: the first fenced block after the marker, comments dropped.
mapfile -t commands < <(awk '
  /<!-- newcomer.sh runs the next block -->/ { armed = 1; next }
  armed && /^```/ { if (inside) exit; inside = 1; next }
  inside { sub(/[[:space:]]+#.*$/, ""); if ($0 ~ /[^[:space:]]/) print }
' "$root/README.md")
if [ ${#commands[@]} -eq 0 ]; then
  echo "newcomer: README.md has no block after <!-- newcomer.sh runs the next block -->" >&2
  exit 2
fi
if [ "$dry_run" = 1 ]; then
  printf 'would run: %s\n' "${commands[@]}"
  exit 0
fi

if [ -z "$workdir" ]; then
  workdir="$(mktemp -d -t sparsebalance-newcomer.XXXXXX)"
  trap 'rm -rf "$workdir"' EXIT
fi
mkdir -p "$workdir"
clone="$workdir/sparsebalance"
if [ -n "$(git -C "$root" status --porcelain --untracked-files=no)" ]; then
  echo "[newcomer] note: $root has uncommitted changes; the clone has the last commit only"
fi
git clone --quiet "$root" "$clone"
echo "[newcomer] fresh clone of $(git -C "$clone" rev-parse --short HEAD) in $clone"

# Nothing of this machine's setup: no active virtual environment, no SparseBalance variables.
unset VIRTUAL_ENV SPARSEBALANCE_VENV PYTHONPATH
PATH="$(printf '%s' "$PATH" | tr ':' '\n' | grep -v -x -F "$root/.venv/bin" | paste -sd: -)"
export PATH
if [ "$fresh_home" = 1 ]; then
  export HOME="$workdir/home"
  mkdir -p "$HOME"
  echo "[newcomer] empty cache: HOME=$HOME"
fi

cd "$clone"
total=$SECONDS
for cmd in "${commands[@]}"; do
  echo "[newcomer] \$ $cmd"
  start=$SECONDS
  set +e
  bash -c "$cmd"
  code=$?
  set -e
  took=$((SECONDS - start))
  echo "[newcomer] $cmd: exit $code after $((took / 60)) min $((took % 60)) s"
  [ "$code" -eq 0 ] || exit "$code"
done
took=$((SECONDS - total))
echo "[newcomer] done: ${#commands[@]} commands in $((took / 60)) min $((took % 60)) s"
