"""``sparsebalance bench-e2e``: the baseline / SAB / DST / SAB+DST ablation measured end to end with
the real trainer on the same samples (2 gloo ranks on CPU, or ``--emulate-ranks R`` to run R ranks'
micro-batches in turn on one device), with the simulator's prediction for the same batches beside
it. Writes a dated results file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..report import comparison_table
from ..results import write_results
from ..train import add_train_arguments, config_from_args
from ..train.ablation import ABLATION, ablation_configs, measure, predict
from ..train.launch import default_nproc, uses_cuda


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strategies",
        default=",".join(ABLATION),
        help=f"comma-separated subset of {', '.join(ABLATION)} (baseline always runs)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes (default: 2 on CPU; 1 with --emulate-ranks)",
    )
    p.add_argument("--results-dir", default="benchmarks/results", help="'' to write nothing")
    p.add_argument(
        "--reuse-runs",
        action="store_true",
        help="report the runs already in --out instead of training again",
    )
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")
    add_train_arguments(p)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.out is None:
        args.out = "runs/bench-e2e"
    cfg = config_from_args(args)
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    configs = ablation_configs(cfg, names)
    cuda = uses_cuda(cfg)
    nproc = default_nproc(cfg, args.nproc)
    world = cfg.emulate_ranks or nproc
    measured = measure(configs, nproc, reuse=args.reuse_runs)
    baseline_dir = Path(configs["baseline"].out)
    predicted = predict(cfg, list(configs), world, baseline_dir)["strategies"]
    table, payload = comparison_table(measured, "baseline", predicted)
    mode = f"{cfg.emulate_ranks} emulated ranks" if cfg.emulate_ranks else f"{nproc} processes"
    notes = (
        f"{mode}, model {cfg.model}, {cfg.steps} steps (step 1 excluded), global batch "
        f"{cfg.global_batch}, capacity {cfg.capacity}, gamma0 {cfg.dst.gamma0}. Speedup: baseline "
        "mean step time / strategy's; compute speedup uses the slowest rank's compute time. "
        "Predicted: the simulator on the same batches with the baseline run's latency model "
        "(its profile, recalibrated online up to its last step) and the estimator's starting "
        "densities; its error is against the measured slowest-rank compute time."
    )
    result = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "strategies": payload}
    if args.results_dir:
        device = torch.device("cuda" if cuda else "cpu")
        md, _ = write_results(args.results_dir, "bench-e2e", device, table, result, notes)
        result["results_file"] = str(md)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(
            table
            + "\n\n"
            + notes
            + (f"\n\nwrote {result['results_file']}" if args.results_dir else "")
        )
    return 0
