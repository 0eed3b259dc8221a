"""How long the command line takes to answer what needs no work (issue 55's target: < 1 s alone):
every command's ``--help``, a mistyped flag (did-you-mean) and a value of the wrong choice or type.
Each is a fresh ``sparsebalance`` process, as a user types it; the median of ``--repeats`` runs,
with the 1-minute load before and after (a figure is only "alone" at a load near 0).

    .venv/bin/python benchmarks/cli_answers.py              # writes benchmarks/results/
    .venv/bin/python benchmarks/cli_answers.py --quick      # one run each, writes nothing

Run alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from sparsebalance.cli import COMMANDS
from sparsebalance.results import markdown_table, write_results

ASKS = [
    *([name, "--help"] for name in COMMANDS),
    ["train", "--stesp", "3"],  # the probe's did-you-mean
    ["train", "--strategy", "sabb"],  # a wrong choice
    ["simulate", "--steps", "x"],  # a wrong type
]


def answer_seconds(argv: list[str], repeats: int) -> float:
    """Median wall seconds of ``sparsebalance ARGV`` in a fresh process."""
    exe = shutil.which("sparsebalance") or str(Path(sys.executable).parent / "sparsebalance")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([exe, *argv], capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="one run each, no results file")
    p.add_argument("--results-dir", default="benchmarks/results")
    args = p.parse_args()
    repeats = 1 if args.quick else args.repeats
    load_before = os.getloadavg()[0]
    rows = [[" ".join(argv), answer_seconds(argv, repeats)] for argv in ASKS]
    load_after = os.getloadavg()[0]
    table = markdown_table(["sparsebalance ...", f"median s ({repeats} runs)"], rows)
    print(table)
    notes = f"1-minute load {load_before:.2f} before, {load_after:.2f} after, on {os.cpu_count()} cores."
    print(notes)
    if not args.quick:
        md, _ = write_results(
            args.results_dir, "cli-answers", torch.device("cpu"), table, {"rows": rows, "repeats": repeats}, notes
        )
        print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
