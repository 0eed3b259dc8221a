"""``sparsebalance report RUN_DIR``: markdown + PNG report of one training run or several;
``--results-dir`` also writes the comparison as a dated results file (for figures you quote)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..files import check_output_folder
from ..report import table_note, write_report
from ..results import write_results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run folder (metrics.jsonl) or a folder of run folders")
    p.add_argument("--no-plots", action="store_true", help="markdown only")
    p.add_argument(
        "--results-dir",
        default=None,
        help="also write <date>-<name>-<device>.md/.json there (e.g. benchmarks/results)",
    )
    p.add_argument("--name", default="train-report", help="results file name (with --results-dir)")
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")


def main(args: argparse.Namespace) -> int:
    if args.results_dir:
        check_output_folder(args.results_dir, "--results-dir")
    path, comparison = write_report(args.run_dir, plots=not args.no_plots)
    wrote = [f"wrote {path}"]
    if args.results_dir:
        root = Path(args.run_dir)
        configs = {p.parent.name: json.loads(p.read_text()) for p in sorted(root.glob("**/config.json"))}
        table = path.read_text().split("\n\n")[1]
        device = torch.device("cuda" if any(c.get("device") == "cuda" for c in configs.values()) else "cpu")
        notes = f"Runs in `{root}` (their configurations are in the JSON file). " + table_note(comparison)
        md, js = write_results(
            args.results_dir, args.name, device, table, {"comparison": comparison, "configs": configs}, notes
        )
        comparison = {**comparison, "results_file": str(md), "results_json": str(js)}
        wrote.append(f"wrote {md} and {js.name}{_kept(md, args.name, device)}")
    print(json.dumps(comparison, indent=2) if args.json else "\n".join(wrote))
    return 0


def _kept(md: Path, name: str, device: torch.device) -> str:
    """Why a results file has a suffix: today's file of that name exists and was kept."""
    first = md.with_name(f"{md.name[:10]}-{name}-{device.type}.md")  # <YYYY-MM-DD>-name-device
    return "" if first == md else f" ({first.name} exists from earlier today and is kept)"
