"""``sparsebalance train``: distributed training of a Hugging Face causal LM with packed sparse
attention, SAB and DST (launches torchrun itself). ``--demo`` trains the baseline (sequential
batching, fixed gamma) and SparseBalance (SAB + DST) on the same samples and compares them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..report import write_report
from ..train import add_train_arguments, config_from_args
from ..train.launch import RunFailed, default_nproc, demo_configs, launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to launch (default: 2 on CPU, the number of GPUs on CUDA)",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="baseline vs SparseBalance on the same samples, then a comparison + report",
    )
    p.add_argument("--json", action="store_true", help="print only JSON (the comparison) to stdout")
    add_train_arguments(p)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    nproc = default_nproc(cfg, args.nproc)
    runs = demo_configs(cfg) if args.demo else {"run": cfg}
    for name, run_cfg in runs.items():
        if not args.json:
            print(f"== {name}: strategy={run_cfg.strategy}, dst={run_cfg.dst.mode}, ranks={nproc}, "
                  f"steps={run_cfg.steps} -> {run_cfg.out}", flush=True)  # fmt: skip
        try:
            launch(run_cfg, nproc)
        except RunFailed as err:
            if err.reported:  # rank 0 already said why in one line
                return err.code
            raise
    path, comparison = write_report(Path(cfg.out))
    if args.json:
        print(json.dumps(comparison, indent=2))
    else:
        print((path.read_text().split("\n\n")[1]) + f"\n\nreport: {path}")
    return 0
