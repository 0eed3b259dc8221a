"""``sparsebalance simulate``: replay many steps over R virtual data-parallel ranks with the
trainer's planner (SAB), tuner (DST) and latency model, and compare baseline / SAB / DST /
SAB+DST (and SAB+DST with each DST anchor) on predicted step time, balance, bubbles, attention
density and budget moved.

Batches: ``R x --samples-per-rank`` documents per step from ``--dist heavy|uniform|bimodal`` or a
``--lengths FILE`` (one length per line, or JSON with a ``lengths`` list and optional paired
``densities``); densities at gamma0 from the documented power-law model (see
``sparsebalance.simulate.sparsity``) unless the file has them. Cost: ``--profile P`` or the
analytic FLOP-count profile (``--analytic h100|h200 --model ... --efficiency E``), plus the
optimizer step and a ring all-reduce of bf16 gradients per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..latency import ACCELERATORS
from ..models import BUILTIN_MODELS
from ..results import markdown_table
from ..simulate import BUILTIN, DEFAULT_STRATEGIES, LengthDistribution, SimConfig, SparsityModel
from ..simulate.scenario import run_simulation
from ..tuning import DSTConfig, add_dst_arguments


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x.replace("_", "")) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 8,64,512, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=_int_list, required=True, metavar="R[,R2,...]")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--micro-batches", type=int, metavar="M", help="micro-batches per rank")
    group.add_argument("--capacity", type=int, metavar="C", help="tokens per micro-batch")
    p.add_argument("--steps", type=int, default=20, help="global batches to replay (20)")
    p.add_argument("--samples-per-rank", type=int, default=8, help="documents per rank (8)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--dist", choices=BUILTIN, default="heavy", help="length distribution")
    src.add_argument("--lengths", metavar="FILE", help="lengths file (resampled)")
    p.add_argument("--min-len", type=int, default=128, help="shortest built-in length (128)")
    p.add_argument("--max-len", type=int, default=32768, help="longest built-in length (32768)")
    sm = SparsityModel()
    p.add_argument("--density-at-4k", type=float, default=sm.density_at_4k)
    p.add_argument("--density-slope", type=float, default=sm.slope)
    p.add_argument("--density-noise", type=float, default=sm.noise)
    p.add_argument(
        "--curve-alpha", default="1,1", metavar="LOW,HIGH",
        help="density-response exponents below/above gamma0 (1,1)",
    )  # fmt: skip
    cost = p.add_mutually_exclusive_group()
    cost.add_argument("--profile", metavar="P", help="measured latency profile")
    cost.add_argument("--analytic", choices=sorted(ACCELERATORS), default="h100")
    p.add_argument("--model", default="qwen2.5-0.5b", help=f"one of {', '.join(BUILTIN_MODELS)}")
    p.add_argument("--efficiency", type=float, default=0.45, help="GEMM fraction of peak")
    p.add_argument("--attention-efficiency", type=float, default=0.35)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument(
        "--ring", choices=("auto", "flat", "hierarchical"), default="auto",
        help="ring of documents sab-cp splits over several ranks (auto)",
    )  # fmt: skip
    p.add_argument(
        "--strategy", default=",".join(DEFAULT_STRATEGIES),
        help="comma list: baseline, sab, dst, sab+dst, sab+dst@ANCHOR, sab-cp, sab-cp+dst, "
        "PLANNER[+dst|+down]",
    )  # fmt: skip
    add_dst_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="processes over steps (1)")
    p.add_argument("--show-step", type=int, default=0, help="step drawn in the rank-time plot")
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots to DIR")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Validate everything (``ValueError`` naming the flag) before any work."""
    if args.lengths is not None:
        lengths = LengthDistribution.from_file(args.lengths)
    else:
        lengths = LengthDistribution(args.dist, args.min_len, args.max_len)
    try:
        alpha = tuple(float(x) for x in args.curve_alpha.split(","))
    except ValueError:
        alpha = ()
    if len(alpha) != 2:
        raise ValueError(f"--curve-alpha must be LOW,HIGH (two numbers), got {args.curve_alpha!r}")
    names = tuple(x.strip() for x in args.strategy.split(",") if x.strip())
    if not names:
        raise ValueError("--strategy needs at least one name")
    return SimConfig(
        world_sizes=args.world_size,
        micro_batches=args.micro_batches,
        capacity=args.capacity,
        samples_per_rank=args.samples_per_rank,
        steps=args.steps,
        seed=args.seed,
        lengths=lengths,
        sparsity=SparsityModel(
            args.density_at_4k, args.density_slope, args.density_noise, args.block_size
        ),
        dst=DSTConfig.from_args(args),
        curve_alpha=alpha,
        strategies=names,
        profile=args.profile,
        analytic=args.analytic,
        model=args.model,
        efficiency=args.efficiency,
        attention_efficiency=args.attention_efficiency,
        block_size=args.block_size,
        ring=args.ring,
        show_step=args.show_step,
        workers=args.workers,
    )


def format_table(result: dict) -> str:
    """One row per strategy of one world size; times in milliseconds."""
    headers = ["strategy", "step ms", "speedup", "balance eff", "bubble frac", "mean density",
               "budget cut %", "budget given %", "ranks cut", "ranks raised", "split docs",
               "comm ms"]  # fmt: skip
    rows = [
        [name, s["step_seconds"] * 1e3, s["speedup"], s["balance_efficiency"],
         s["bubble_fraction"], s["mean_density"], 100 * s["budget_cut_fraction"],
         100 * s["budget_given_fraction"], s["ranks_cut"], s["ranks_raised"],
         s["split_documents"], s["comm_seconds"] * 1e3]
        for name, s in result["strategies"].items()
    ]  # fmt: skip
    return markdown_table(headers, rows)


def write_plots(summary: dict, out_dir: str) -> list[Path]:
    from ..simulate.plots import plot_rank_times, plot_speedup

    out = Path(out_dir)
    paths = [plot_speedup(summary, out / "speedup_vs_world_size.png")]
    for res in summary["results"]:
        paths.append(plot_rank_times(res, out / f"rank_times_R{res['world_size']}.png"))
    return paths


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    summary = run_simulation(config)
    plots = write_plots(summary, args.plot) if args.plot else []
    summary["plots"] = [str(p) for p in plots]
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    bound = f"M = {config.micro_batches}" if config.capacity is None else f"C = {config.capacity}"
    print(
        f"cost model: {summary['cost_model']}\nlengths: {summary['lengths']}; densities: "
        f"{summary['sparsity']}\n{config.steps} steps x {config.samples_per_rank} samples per "
        f"rank, {bound}, seed {config.seed}; DST p = {config.dst.p}, gamma0 = "
        f"{config.dst.gamma0} in [{config.dst.gamma_min}, {config.dst.gamma_max}]"
    )
    for res in summary["results"]:
        print(
            f"\nR = {res['world_size']} (all-reduce + optimizer "
            f"{res['step_overhead_seconds'] * 1e3:.1f} ms per step; simulated in "
            f"{res['wall_seconds']:.1f} s)"
        )
        print(format_table(res))
    for path in plots:
        print(f"wrote {path}", file=sys.stderr)
    return 0
