"""Two simulator checks, run as the CLI a user would type, timed, written to a dated results file:

1. scale (issue 7): ``sparsebalance simulate`` at 4,096 ranks x 100 steps for the four ablations;
2. SAB and SAB+DST against a *token-balanced* plan (``tokens``) rather than dataset order.

    .venv/bin/python benchmarks/simulate_checks.py [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from sparsebalance.results import markdown_table, write_results

OUT = Path(__file__).parent / "results"
BASE = ["--micro-batches", "4", "--analytic", "h100", "--model", "qwen2.5-0.5b", "--json"]


def run(args: list[str]) -> tuple[dict, float, float]:
    """(JSON output, wall seconds, CPU seconds of the child processes)."""
    cmd = [sys.executable, "-m", "sparsebalance", "simulate", *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out), wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    scale = [
        "--world-size",
        "4096",
        "--steps",
        "100",
        "--strategy",
        "baseline,sab,dst,sab+dst",
        "--workers",
        str(args.workers),
        *BASE,
    ]
    _, wall, cpu = run(scale)
    load = os.getloadavg()[0]
    tok = ["--world-size", "64", "--steps", "10", "--dist", "heavy", "--strategy", "tokens,sab,sab+dst", *BASE]
    res, _, _ = run(tok)
    rows = res["results"][0]["strategies"] if "results" in res else res["strategies"]
    t_tokens = rows["tokens"]["step_seconds"]
    table1 = markdown_table(
        ["command", "wall s", "CPU s", "1-min load after"],
        [["sparsebalance simulate " + " ".join(scale), wall, cpu, f"{load:.2f}"]],
    )
    table2 = markdown_table(
        ["strategy", "predicted step s", "speedup vs tokens", "speedup vs sequential"],
        [[n, r["step_seconds"], t_tokens / r["step_seconds"], r["speedup"]] for n, r in rows.items()],
    )
    text = (
        "## Scale: 4,096 ranks x 100 steps (target < 60 s)\n\n"
        + table1
        + "\n\n## Against a token-balanced plan (R = 64, heavy lengths, 10 steps)\n\n"
        "`sparsebalance simulate " + " ".join(tok) + "`\n\n" + table2
    )
    md, _ = write_results(
        OUT,
        "simulate-checks",
        torch.device("cpu"),
        text,
        {"scale": {"wall_s": wall, "cpu_s": cpu, "load": load}, "tokens_baseline": rows},
    )
    print(text + f"\n\nwrote {md}")


if __name__ == "__main__":
    main()
