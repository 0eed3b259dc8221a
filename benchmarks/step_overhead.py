"""The host work a step adds before any kernel runs: SAB's plan and DST's step decision, as the
step engine runs them (``StepEngine.plan`` + ``StepEngine.tune``), for the setting of
``scripts/gpu_check.sh``'s train stage (8 emulated ranks, Qwen2.5-0.5B, capacity 32K tokens,
the analytic H100 profile), at several global batches.

    .venv/bin/python benchmarks/step_overhead.py            # writes benchmarks/results/
    .venv/bin/python benchmarks/step_overhead.py --quick    # smoke run, writes nothing

Document lengths: log-normal (median ~5K tokens), 128..32,768. The first step of each setting is
a warm-up; the median of the others is reported. DST's per-layer decisions are not in this
figure (they run inside the forward; under top-k on a GPU they no longer wait for the device).
Run alone.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from sparsebalance.batching import PlanConfig
from sparsebalance.engine import Kernel, StepEngine
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.results import markdown_table, write_results
from sparsebalance.tuning import DSTConfig
from sparsebalance.workload import Sample


def measure(global_batch: int, steps: int, ranks: int, seed: int = 0) -> dict:
    shapes = load_shapes("qwen2.5-0.5b")
    latency = LatencyModel(analytic_profile(shapes, "h100", block_size=128))
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(8.5, 1.2, 4 * global_batch).astype(int), 128, 32768)
    engine = StepEngine(
        PlanConfig(ranks, None, 32768),
        latency,
        DSTConfig(),
        lambda i: Sample(i, int(lengths[i])),
        kernel=Kernel(torch.device("cuda"), 128, "flex", "bf16", "expand"),  # an H100 run's, on any host
        world_size=1,
    )
    plan_s, dst_s = [], []
    for _ in range(steps + 1):
        ids = rng.choice(lengths.size, global_batch, replace=False)
        tuned = engine.begin([Sample(int(i), int(lengths[i])) for i in ids])
        plan_s.append(tuned.planned.plan.metrics.plan_seconds)
        dst_s.append(tuned.dst_seconds)
    plan, dst = statistics.median(plan_s[1:]), statistics.median(dst_s[1:])
    return {
        "global_batch": global_batch,
        "ranks": ranks,
        "plan_ms": 1e3 * plan,
        "dst_ms": 1e3 * dst,
        "total_ms": 1e3 * (plan + dst),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per setting (default 20)")
    p.add_argument("--quick", action="store_true", help="2 steps, one setting, no results file")
    p.add_argument("--out", default="benchmarks/results", help="results folder")
    args = p.parse_args()
    batches = [8] if args.quick else [8, 16, 64]
    rows = [measure(b, 2 if args.quick else args.steps, 8) for b in batches]
    table = markdown_table(
        ["global batch", "ranks", "plan (ms)", "DST step decision (ms)", "total (ms)"],
        [[r["global_batch"], r["ranks"], r["plan_ms"], r["dst_ms"], r["total_ms"]] for r in rows],
    )
    print(table)
    if not args.quick:
        import torch

        notes = (
            "Run as `python benchmarks/step_overhead.py`, alone. 8 emulated ranks, Qwen2.5-0.5B "
            "shapes, capacity 32K tokens, the analytic H100 profile, block 128; log-normal "
            "lengths 128..32,768; median of the timed steps after one warm-up. Host work only: "
            "DST's per-layer decisions run inside the forward and are not in this figure."
        )
        md, js = write_results(
            args.out, "step-overhead", torch.device("cpu"), table, {"rows": rows, "steps": args.steps}, notes
        )
        print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
