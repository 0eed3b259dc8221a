"""``sparsebalance simulate``: replay many steps over R virtual data-parallel ranks with the
trainer's planner (SAB), tuner (DST) and latency model, and compare baseline / SAB / DST /
SAB+DST (and SAB+DST with each DST anchor) on predicted step time, balance, bubbles, attention
density and budget moved.

Batches: ``R x --samples-per-rank`` documents per step from ``--dist heavy|uniform|bimodal`` or a
``--lengths FILE`` (one length per line, or JSON with a ``lengths`` list and optional paired
``densities``); densities at gamma0 (the documents' content) from the power-law model (see
``sparsebalance.simulate.sparsity``) unless the file has them. Cost: ``--profile P`` (with
``--model``, only the model it was made for) or the analytic FLOP-count profile (``--analytic
h100|h200 --model ... --efficiency E``), plus the optimizer step and a ring all-reduce of bf16
gradients per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from .. import flags
from ..batching.zero_bubble import SCHEDULES
from ..files import check_output_folder
from ..results import markdown_table
from ..simulate import LengthDistribution, SimConfig
from ..simulate.scenario import cost_inputs, run_simulation

# Filled by the command itself: the lengths file (``--lengths FILE``).
_SKIP = ("lengths.lengths", "lengths.densities")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """:class:`SimConfig`'s flags (generated from its fields), ``--lengths FILE``, output flags."""
    p.add_argument(
        "--config",
        default=None,
        help="TOML (or JSON) file: keys = SimConfig fields, sections [lengths] [sparsity] [dst]",
    )
    groups = flags.add_arguments(
        p,
        SimConfig,
        skip=_SKIP,
        exclusive=[("micro_batches", "capacity"), ("lengths.name",), ("profile", "analytic")],
        choices={"pipeline_schedule": SCHEDULES},
    )
    groups["lengths.name"].add_argument(
        "--lengths",
        dest="lengths_file",
        metavar="FILE",
        help="lengths file (one per line, or JSON with lengths [+ densities]), resampled",
    )
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots to DIR")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Defaults < ``--config`` < flags; validated (``ValueError`` naming the flag) before any
    work."""
    values = flags.load_file(args.config) if args.config else {}
    where = f"--config {args.config}" if args.config else "flags"
    flags.check_values(SimConfig, values, where)
    given = flags.values_from_args(args, SimConfig)
    flags.check_values(SimConfig, given, "flags")
    values = flags.merge(values, given)
    if values.get("strategies") == ():
        raise ValueError("--strategy needs at least one name")
    config = flags.build(SimConfig, values, where)
    if args.lengths_file is not None:
        config = replace(config, lengths=LengthDistribution.from_file(args.lengths_file))
    return config


def format_table(result: dict) -> str:
    """One row per strategy of one world size; times in milliseconds (with ``--pp``: also the
    devices' idle share inside the step and the max / mean micro-batch time)."""
    headers = [
        "strategy",
        "step ms",
        "speedup",
        "balance eff",
        "bubble frac",
        "mean density",
        "budget cut %",
        "budget given %",
        "ranks cut",
        "ranks raised",
        "split docs",
        "comm ms",
    ]
    rows = [
        [
            name,
            s["step_seconds"] * 1e3,
            s["speedup"],
            s["balance_efficiency"],
            s["bubble_fraction"],
            s["mean_density"],
            100 * s["budget_cut_fraction"],
            100 * s["budget_given_fraction"],
            s["ranks_cut"],
            s["ranks_raised"],
            s["split_documents"],
            s["comm_seconds"] * 1e3,
        ]
        for name, s in result["strategies"].items()
    ]
    if all("device_idle_fraction" in s for s in result["strategies"].values()):
        headers += ["device idle", "mb imbalance"]
        for row, s in zip(rows, result["strategies"].values(), strict=True):
            row += [s["device_idle_fraction"], s["microbatch_imbalance"]]
    return markdown_table(headers, rows)


def order_note(result: dict) -> str | None:
    """The line saying that sab's pipeline plans went unsearched in some steps (too many
    micro-batches per pipeline: :data:`~sparsebalance.batching.pipeline.ORDER_SEARCH_MAX`)."""
    from ..batching.pipeline import ORDER_SEARCH_MAX

    skipped = [s["order_search_skipped"] for s in result["strategies"].values() if s.get("order_search_skipped")]
    steps, most = max(skipped, key=lambda x: (x[1], x[0]), default=(0, 0))
    if not steps:
        return None
    return (
        f"note: sab did not search the pipeline order in {steps} of {result['num_steps']} steps: up to {most} "
        f"micro-batches per pipeline, more than {ORDER_SEARCH_MAX} (their search grows with the cube); they run "
        "in ascending predicted time (a larger --capacity makes fewer)"
    )


def pipeline_line(config: SimConfig, layers: list[int]) -> str:
    """What each rank's pipeline is (schedule, stages, layers per stage), in one line."""
    p, v = config.pipeline_stages, config.pipeline_virtual
    if config.pipeline_schedule == "zb-h1":
        share = config.pipeline_weight_share
        kind = f"a zero-bubble ZB-H1 pipeline of {p} stages (weights' gradient {share:.2f} of a backward)"
    elif v > 1:
        kind = f"an interleaved 1F1B pipeline of {p} stages x {v} chunks"
    else:
        kind = f"a 1F1B pipeline of {p} stages"
    return (
        f"pipelines: each rank is {kind} (layers per {'virtual stage' if v > 1 else 'stage'} {layers}; makespan, "
        "bubbles included); sab packs and orders micro-batches for it and DST anchors on it"
    )


def write_plots(summary: dict, out_dir: str) -> list[Path]:
    from ..simulate.plots import plot_rank_times, plot_speedup

    out = Path(out_dir)
    paths = [plot_speedup(summary, out / "speedup_vs_world_size.png")]
    for res in summary["results"]:
        paths.append(plot_rank_times(res, out / f"rank_times_R{res['world_size']}.png"))
    return paths


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    cost_inputs(config)  # --model and --profile readable and of one model, before simulating
    if args.plot:  # before simulating: its results are never lost to an output error
        check_output_folder(args.plot, "--plot")
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
        f"rank, {bound}, seed {config.seed}; {config.dst.describe()}"
    )
    if config.pipeline_stages > 1:
        print(pipeline_line(config, summary["stage_layers"]))
    if config.pad_micro_batches:
        print(
            "padded micro-batches: every document costs its micro-batch's longest (no packing, every "
            "strategy); sab also prices length-grouped micro-batches"
        )
    for res in summary["results"]:
        print(
            f"\nR = {res['world_size']} (all-reduce + optimizer "
            f"{res['step_overhead_seconds'] * 1e3:.1f} ms per step; simulated in "
            f"{res['wall_seconds']:.1f} s)"
        )
        print(format_table(res))
        note = order_note(res)
        if note:
            print(note)
    for path in plots:
        print(f"wrote {path}", file=sys.stderr)
    return 0
