"""Hybrid data x context parallel plans (``sab-cp``) against whole-document ``sab``, simulated.

Goals of issue 14 (predicted by the analytic H100 profile, not measured):
1. heavy-tailed lengths whose longest document exceeds the average rank's work (``--dist heavy
   --max-len 131072``, M = 4, 8 documents per rank) at 8 / 64 / 1,024 ranks: balance efficiency
   and step time of sab-cp vs sab at the same density (DST off), and with DST;
2. never worse than sab: uniform lengths where no split helps;
3. documents far longer than the capacity (``--dist longtail --max-len 262144 --capacity 32768``);
4. planning time: 8,192 documents over 1,024 ranks (median of ``--repeats`` runs);
5. simulator wall time: 4,096 ranks x ``--timing-steps`` steps, default strategies + sab-cp(+dst).

    PYTHONPATH=src .venv/bin/python benchmarks/hybrid_cp.py [--steps 5] [--timing-steps 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.latency import LatencyModel, analytic_links, analytic_profile
from sparsebalance.latency.context import ContextCost
from sparsebalance.models import load_shapes
from sparsebalance.results import markdown_table, write_results
from sparsebalance.simulate import DEFAULT_STRATEGIES, LengthDistribution, SimConfig, SparsityModel
from sparsebalance.simulate.scenario import run_simulation
from sparsebalance.workload import Sample

OUT = Path(__file__).parent / "results"
STRATS = ("sab", "sab+dst", "sab-cp", "sab-cp+dst")


def _row(tag, res):
    s = res["strategies"]
    return [
        tag,
        res["world_size"],
        s["sab"]["balance_efficiency"],
        s["sab-cp"]["balance_efficiency"],
        s["sab"]["step_seconds"] / s["sab-cp"]["step_seconds"],
        s["sab"]["compute_seconds"] / s["sab-cp"]["compute_seconds"],
        s["sab+dst"]["step_seconds"] / s["sab-cp+dst"]["step_seconds"],
        s["sab-cp"]["split_documents"],
        s["sab-cp"]["comm_seconds"] * 1e3,
        s["sab-cp+dst"]["mean_density"] / s["sab-cp"]["mean_density"],
    ]


def scenarios(args) -> tuple[list, list, dict]:
    rows, sections, payload = [], [], {}
    runs = [
        ("heavy 131K, M=4", dict(lengths=LengthDistribution("heavy", 128, 131072), micro_batches=4), (8, 64, 1024)),
        ("uniform 1K-16K, M=4", dict(lengths=LengthDistribution("uniform", 1024, 16384), micro_batches=4), (8, 64)),
        ("longtail 256K, C=32K", dict(lengths=LengthDistribution("longtail", 128, 262144), capacity=32768), (8, 64)),
    ]
    for tag, kw, sizes in runs:
        for r in sizes:
            steps = args.steps if r < 1024 else max(1, args.steps // 2)
            cfg = SimConfig(world_sizes=(r,), steps=steps, strategies=STRATS, **kw)
            t0 = time.perf_counter()
            summary = run_simulation(cfg)
            res = summary["results"][0]
            rows.append(_row(tag, res))
            payload[f"{tag} R={r}"] = res["strategies"]
            print(f"{tag} R={r}: {time.perf_counter() - t0:.1f} s", flush=True)
            sections.append((tag, r, steps, summary["cost_model"]))
    return rows, sections, payload


def planning_time(repeats: int) -> dict:
    shapes = load_shapes("qwen2.5-0.5b")
    model = LatencyModel(analytic_profile(replace(shapes, max_context=70000), "h100", block_size=128))
    cost = ContextCost.for_shapes(model, shapes, analytic_links("h100"), block_size=128)
    rng = np.random.default_rng(0)
    lens, _ = LengthDistribution("heavy", 128, 131072).sample(rng, 8192)
    dens = SparsityModel().sample(rng, lens, 128)
    samples = [Sample(i, int(n)) for i, n in enumerate(lens)]
    out = {}
    for strategy in ("sab", "sab-cp"):
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = plan_batch(samples, cost, PlanConfig(1024, micro_batches=4, strategy=strategy), densities=dens)
            walls.append(time.perf_counter() - t0)
        out[strategy] = {
            "median_ms": 1e3 * statistics.median(walls),
            "min_ms": 1e3 * min(walls),
            "max_time": plan.metrics.max_time,
            "efficiency": plan.metrics.efficiency,
            "split": plan.metrics.num_split_documents,
        }
    return out


def sim_timing(steps: int, workers: int) -> dict:
    strategies = (*DEFAULT_STRATEGIES, "sab-cp", "sab-cp+dst")
    out = {}
    for name, strats in (("default", DEFAULT_STRATEGIES), ("default+sab-cp", strategies)):
        cfg = SimConfig(world_sizes=(4096,), micro_batches=4, steps=steps, strategies=strats, workers=workers)
        t0 = time.perf_counter()
        run_simulation(cfg)
        out[name] = time.perf_counter() - t0
        print(f"4096 x {steps} {name}: {out[name]:.1f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timing-steps", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    load = os.getloadavg()
    rows, sections, payload = scenarios(args)
    plan_t = planning_time(args.repeats)
    sim_t = {} if args.skip_timing else sim_timing(args.timing_steps, args.workers)
    load_after = os.getloadavg()
    head = markdown_table(
        [
            "lengths",
            "R",
            "sab balance",
            "sab-cp balance",
            "sab-cp step speed-up vs sab",
            "compute speed-up",
            "sab-cp+dst vs sab+dst",
            "split docs / step",
            "comm ms (busiest)",
            "density sab-cp+dst / sab-cp",
        ],
        rows,
    )
    plan_rows = [
        [k, v["median_ms"], v["min_ms"], v["max_time"], v["efficiency"], v["split"]] for k, v in plan_t.items()
    ]
    plan_tab = markdown_table(
        [
            "strategy",
            "plan ms (median)",
            "plan ms (min)",
            "predicted step s",
            "efficiency",
            "split docs",
        ],
        plan_rows,
    )
    lines = [f"- {t} R={r}: {n} steps; {desc}" for t, r, n, desc in sections[:1]]
    text = (
        "## sab-cp vs whole-document sab (simulated, analytic H100, Qwen2.5-0.5B)\n\n"
        f"{head}\n\nStep = slowest rank + all-reduce + optimizer; compute speed-up excludes "
        "the per-step all-reduce + optimizer. 8 documents per rank.\n"
        + "\n".join(lines)
        + "\n\n## Planning time: 8,192 documents over 1,024 ranks (heavy 131K, M = 4)\n\n"
        f"{plan_tab}\n"
    )
    if sim_t:
        text += (
            f"\n## Simulator wall time: 4,096 ranks x {args.timing_steps} steps, "
            f"workers = {args.workers}\n\n"
            + markdown_table(["strategies", "seconds"], [[k, v] for k, v in sim_t.items()])
            + "\n"
        )
    text += (
        f"\nLoad average (1/5/15 min) before: {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, "
        f"after: {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} on 2 cores "
        "shared with other engineers' jobs: wall times are inflated and noisy; compare "
        "ratios within this run.\n"
    )
    notes = (
        "All step times are predictions of the analytic FLOP-count profile with analytic "
        "NVLink/InfiniBand links (ContextCost), not measurements."
    )
    md, js = write_results(
        OUT,
        "hybrid-cp",
        torch.device("cpu"),
        text,
        {"scenarios": payload, "planning": plan_t, "simulate_wall": sim_t, "load": [load, load_after]},
        notes,
    )
    print(text)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
