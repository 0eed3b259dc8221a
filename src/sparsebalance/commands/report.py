"""``sparsebalance report RUN_DIR``: markdown + PNG report of one training run or several."""

from __future__ import annotations

import argparse
import json

from ..report import write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run folder (metrics.jsonl) or a folder of run folders")
    p.add_argument("--no-plots", action="store_true", help="markdown only")
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")


def main(args: argparse.Namespace) -> int:
    path, comparison = write_report(args.run_dir, plots=not args.no_plots)
    print(json.dumps(comparison, indent=2) if args.json else f"wrote {path}")
    return 0
