"""Planning speed and quality of the SAB strategies, estimator accuracy, and the probe's cost.

    .venv/bin/python benchmarks/bench_plan.py            # full run, writes benchmarks/results/
    .venv/bin/python benchmarks/bench_plan.py --quick    # smoke run, writes nothing
    .venv/bin/python benchmarks/bench_plan.py --pipelines  # 4. only, writes plan-pipelines + a plot

1. Speed and quality: N = 8192 samples over R = 1024 ranks (M = 4 micro-batches per rank, and
   C = 65536 tokens per micro-batch), every strategy, median planning wall time of ``--repeats``
   runs, predicted step time / efficiency / gap to the lower bound, over 3 seeds. Cost model: the
   analytic (FLOP-count) ``LatencyModel`` profile of qwen2.5-0.5b on an H100. Lengths are
   log-uniform in [1K, 32K]; densities are *synthetic*: ``d_src (L / 8192)^-0.4`` times log-normal
   noise (sigma 0.3), with four sources of different ``d_src``.
2. History estimator: density and latency MAPE against those synthetic realized densities after
   0, 1, 5 and 20 observed steps of 512 samples.
3. Probe: a small torch model (embedding, 4 layers of q/k/v/o projections + block-sparse attention
   + MLP, random weights) on CPU; the probe (embedding + first-layer q/k on block-pooled
   embeddings + the selection rule) is timed against one forward+backward of the model, and its
   density compared with the model's realized density (mean over layers) at gamma = 0.9.
4. Pipelines (``--pipelines``, issue 54): the trainer's host work per step (``StepEngine.plan``:
   SAB with its makespan search, the plan and its hash; ``StepEngine._tune``: DST's step level and
   its budgets per micro-batch), CPU seconds (``time.process_time``), in the paper's setting
   (Qwen2.5-3B shapes, analytic H200, block 256, top-k 8,192 tokens, the balanced stage split) at
   DP 2..64 x PP 4 (M = 4, 8 documents per pipeline) and PP 8 (M = 8, 16 documents), on
   benchmarks/configs/table1.toml's mixes and the simulator's built-in ``heavy`` lengths (to 64K),
   against the simulated step (the slowest pipeline's makespan at DST's budgets, as table1's
   iteration). Median over ``--steps`` steps after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn

import plan_pipelines
from sparsebalance.batching import (
    STRATEGIES,
    HistoryEstimator,
    PlanConfig,
    ProbeEstimator,
    ProbeModel,
    estimator_report,
    mape,
    plan_batch,
)
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.ops import Budget, block_sparse_attention, select_blocks
from sparsebalance.results import markdown_table, write_results
from sparsebalance.workload import Sample

SOURCE_DENSITY = {"web": 0.25, "code": 0.45, "books": 0.15, "chat": 0.35}


def synthetic_batch(n: int, seed: int, lo: int = 1024, hi: int = 32768, with_clean=False):
    """Samples and their synthetic realized densities (see the module docstring)."""
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(int)
    names = list(SOURCE_DENSITY)
    src = [names[i] for i in rng.integers(0, len(names), n)]
    base = np.array([SOURCE_DENSITY[s] for s in src])
    clean = base * (lens / 8192) ** -0.4
    dens = np.clip(clean * rng.lognormal(0, 0.3, n), 0.02, 1.0)
    samples = [Sample(i, int(x), s) for i, (x, s) in enumerate(zip(lens, src, strict=True))]
    return (samples, dens, np.clip(clean, 0.02, 1.0)) if with_clean else (samples, dens)


def bench_planning(args, model) -> list[dict]:
    rows = []
    modes = [("M=4", {"micro_batches": 4}), ("C=65536", {"capacity": 65536})]
    for mode_name, mode in modes:
        for strategy in STRATEGIES:
            per_seed, times = [], []
            for seed in range(args.seeds):
                samples, dens = synthetic_batch(args.samples, seed)
                cfg = PlanConfig(args.ranks, strategy=strategy, **mode)
                for _ in range(args.repeats if seed == 0 else 1):
                    t0 = time.perf_counter()
                    plan = plan_batch(samples, model, cfg, densities=dens)
                    if seed == 0:
                        times.append(time.perf_counter() - t0)
                per_seed.append(plan.metrics)
            eff = [m.efficiency for m in per_seed]
            rows.append(
                {
                    "mode": mode_name,
                    "strategy": strategy,
                    "plan_ms": 1e3 * statistics.median(times),
                    "max_time_s": statistics.mean(m.max_time for m in per_seed),
                    "lower_bound_s": statistics.mean(m.lower_bound for m in per_seed),
                    "efficiency": statistics.mean(eff),
                    "efficiency_std": statistics.pstdev(eff),
                    "gap_to_bound": statistics.mean(m.gap_to_bound for m in per_seed),
                    "microbatches": statistics.mean(m.num_microbatches for m in per_seed),
                    "sab_candidate": per_seed[0].candidate,
                }
            )
    return rows


def bench_history(model) -> list[dict]:
    est = HistoryEstimator()
    test_samples, test_dens, clean = synthetic_batch(2048, seed=1000, with_clean=True)
    # The noise floor: the true curve itself, scored against noisy realized densities.
    oracle = estimator_report(model, test_samples, clean, test_dens)
    rows, seen = [{"observed_steps": "oracle (true curve)", "observed_samples": "-", **oracle}], 0
    for step in range(21):
        if step in (0, 1, 5, 20):
            pred = est.estimate(test_samples)
            rep = estimator_report(model, test_samples, pred, test_dens)
            rows.append({"observed_steps": step, "observed_samples": seen, **rep})
        samples, dens = synthetic_batch(512, seed=step)
        est.observe(samples, dens)
        seen += len(samples)
    return rows


class TinyLM(nn.Module):
    """Embedding + layers of (q, k, v, o, block-sparse attention, MLP); no norms or RoPE."""

    def __init__(self, vocab=4096, hidden=256, heads=4, kv_heads=2, layers=4, block=64):
        super().__init__()
        self.heads, self.kv_heads, self.dim, self.block = heads, kv_heads, hidden // heads, block
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "q": nn.Linear(hidden, hidden),
                    "k": nn.Linear(hidden, kv_heads * self.dim),
                    "v": nn.Linear(hidden, kv_heads * self.dim),
                    "o": nn.Linear(hidden, hidden),
                    "up": nn.Linear(hidden, 3 * hidden),
                    "down": nn.Linear(3 * hidden, hidden),
                }
            )
            for _ in range(layers)
        )

    def forward(self, ids, budget):
        n = ids.numel()
        x = self.embed(ids)
        cu = torch.tensor([0, n], dtype=torch.int32)
        densities = []
        for layer in self.layers:
            q = layer["q"](x).view(n, self.heads, self.dim)
            k = layer["k"](x).view(n, self.kv_heads, self.dim)
            v = layer["v"](x).view(n, self.kv_heads, self.dim)
            lay = select_blocks(q, k, cu, budget, block_size=self.block)
            densities.append(lay.density())
            x = x + layer["o"](block_sparse_attention(q, k, v, lay, cu).reshape(n, -1))
            x = x + layer["down"](torch.relu(layer["up"](x)))
        return x, float(np.mean(densities))


def bench_probe(args) -> list[dict]:
    torch.manual_seed(0)
    lm = TinyLM()
    first = lm.layers[0]
    probe = ProbeModel(lm.embed, first["q"], first["k"], lm.heads, lm.kv_heads, lm.block)
    budget = Budget(gamma=0.9)
    rows = []
    for total in args.probe_lengths:
        g = torch.Generator().manual_seed(total)
        ids = torch.randint(0, 4096, (total,), generator=g)
        est = ProbeEstimator(probe, {0: ids}, budget=budget, block_size=lm.block)
        est.estimate([Sample(0, total)])  # warm-up
        probe_s, step_s = [], []
        for _ in range(args.repeats):
            d_probe = float(est.estimate([Sample(0, total)])[0])
            probe_s.append(est.last_seconds)
            t0 = time.perf_counter()
            out, d_real = lm(ids, budget)
            out.square().mean().backward()
            step_s.append(time.perf_counter() - t0)
            lm.zero_grad(set_to_none=True)
        rows.append(
            {
                "seq_len": total,
                "probe_ms": 1e3 * statistics.median(probe_s),
                "step_ms": 1e3 * statistics.median(step_s),
                "probe_fraction": statistics.median(probe_s) / statistics.median(step_s),
                "probe_density": d_probe,
                "realized_density": d_real,
                "abs_pct_error": mape([d_probe], [d_real]),
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--probe-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192])
    p.add_argument("--quick", action="store_true", help="small sizes, writes nothing")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--pipelines", action="store_true", help="only the pipelines' planning cost (4.)")
    p.add_argument("--steps", type=int, default=5, help="--pipelines: timed steps per setting")
    p.add_argument("--dp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--before", help="--pipelines: a results JSON of the same benchmark to compare with")
    args = p.parse_args()
    if args.pipelines:
        return plan_pipelines.main(args)
    if args.quick:
        args.samples, args.ranks, args.seeds, args.repeats = 512, 64, 1, 1
        args.probe_lengths = [1024]
    model = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h100", block_size=128))
    plan_rows = bench_planning(args, model)
    hist_rows = bench_history(model)
    probe_rows = bench_probe(args)

    t1 = markdown_table(
        [
            "mode",
            "strategy",
            "plan ms (median)",
            "max s",
            "lower bound s",
            "efficiency",
            "eff. std",
            "gap to bound",
            "micro-batches",
        ],
        [
            [
                r["mode"],
                r["strategy"],
                r["plan_ms"],
                r["max_time_s"],
                r["lower_bound_s"],
                r["efficiency"],
                r["efficiency_std"],
                r["gap_to_bound"],
                r["microbatches"],
            ]
            for r in plan_rows
        ],
    )
    t2 = markdown_table(
        ["observed steps", "observed samples", "density MAPE", "latency MAPE", "latency bias"],
        [
            [r["observed_steps"], r["observed_samples"], r["density_mape"], r["latency_mape"], r["latency_bias"]]
            for r in hist_rows
        ],
    )
    t3 = markdown_table(
        ["T", "probe ms", "fwd+bwd ms", "probe / step", "probe density", "realized density", "abs. % error"],
        [
            [
                r["seq_len"],
                r["probe_ms"],
                r["step_ms"],
                r["probe_fraction"],
                r["probe_density"],
                r["realized_density"],
                r["abs_pct_error"],
            ]
            for r in probe_rows
        ],
    )
    title = f"N = {args.samples} samples, R = {args.ranks} ranks, {args.seeds} seeds"
    table = (
        f"## Planning ({title})\n\n{t1}\n\n## History estimator (synthetic densities)\n\n{t2}"
        f"\n\n## Probe cost (CPU, tiny random-weight model)\n\n{t3}"
    )
    print(table)
    if not args.quick and args.out:
        notes = (__doc__ or "").strip()
        payload = {"config": vars(args), "planning": plan_rows, "history": hist_rows, "probe": probe_rows}
        md, js = write_results(args.out, "plan", torch.device("cpu"), table, payload, notes)
        print(f"\nwrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
