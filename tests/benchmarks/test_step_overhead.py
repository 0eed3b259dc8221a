"""benchmarks/step_overhead.py: the step engine's host work (SAB plan + DST step decision) is
timed per setting, and a full run writes a results file that names the script as typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_overhead as bench  # noqa: E402


def test_measure_times_plan_and_dst_for_the_setting():
    row = bench.measure(global_batch=8, steps=2, ranks=4)
    assert (row["global_batch"], row["ranks"]) == (8, 4)
    assert row["plan_ms"] > 0 and row["dst_ms"] > 0
    assert row["total_ms"] == row["plan_ms"] + row["dst_ms"]


def test_a_run_writes_its_results_file_with_the_command(tmp_path):
    cmd = [sys.executable, "benchmarks/step_overhead.py", "--steps", "1", "--out", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    md = next(tmp_path.glob("*-step-overhead-cpu.md")).read_text()
    assert "Command: `python benchmarks/step_overhead.py --steps 1 --out " in md
    assert md.count("\n| ") == 4  # the header and three global batches
