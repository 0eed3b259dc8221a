"""A/B of the torch backend between two source trees: ``sparsebalance bench-attn --quick`` runs
alternately with ``PYTHONPATH=<baseline>`` and ``PYTHONPATH=<candidate>`` (same process setup,
same machine, interleaved so load drifts hit both), and the per-row ratio candidate / baseline of
the median fwd+bwd time is reported. Used to check that a kernel refactor does not regress.

    python benchmarks/attn_kernel_ab.py --baseline /tmp/base/src --candidate src --rounds 3

Writes ``benchmarks/results/<date>-attn-kernel-ab-cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

from sparsebalance.results import markdown_table, write_results


def _run(src: str, extra: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    cmd = [sys.executable, "-m", "sparsebalance", "bench-attn", "--quick", "--json", *extra]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["rows"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="src folder of the baseline tree")
    p.add_argument("--candidate", default="src", help="src folder of the candidate tree")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs of each tree")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("extra", nargs="*", help="extra bench-attn flags (after --)")
    args = p.parse_args()
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    load = [os.getloadavg()]
    runs = {"baseline": [], "candidate": []}
    for _ in range(args.rounds):
        for name in ("baseline", "candidate"):
            runs[name].append(_run(getattr(args, name), ["--backends", "torch", *args.extra]))
            load.append(os.getloadavg())
    rows = []
    for i, row in enumerate(runs["baseline"][0]):
        base = [r[i]["seconds"] for r in runs["baseline"]]
        cand = [r[i]["seconds"] for r in runs["candidate"]]
        med = statistics.median
        rows.append(
            {
                "seq_len": row["seq_len"],
                "density": row["target_density"],
                "baseline_min_s": min(base),
                "candidate_min_s": min(cand),
                "ratio_min": min(cand) / min(base),
                "ratio_median": med(cand) / med(base),
            }
        )
    table = markdown_table(
        ["T", "density", "baseline min s", "candidate min s", "ratio (min)", "ratio (median)"],
        [
            [r["seq_len"], r["density"], r["baseline_min_s"], r["candidate_min_s"], r["ratio_min"], r["ratio_median"]]
            for r in rows
        ],
    )
    notes = (
        f"{args.rounds} interleaved rounds of `bench-attn --quick --backends torch` per tree (each"
        " row of a run is itself the median of its repeats); ratio = candidate / baseline of the"
        " fastest (min) and of the median round. Load average (1, 5, 15 min) before and after"
        f" each run: {load}. The machine is shared with other jobs (load far above its 2 cores),"
        " so absolute times are noisy; the min ratio is the least noisy claim."
    )
    payload = {"rows": rows, "runs": runs, "load": load, "config": vars(args)}
    if args.out:
        md, js = write_results(args.out, "attn-kernel-ab", torch.device("cpu"), table, payload, notes)
        print(f"wrote {md} and {js}", file=sys.stderr)
    print(table + "\n\n" + notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
