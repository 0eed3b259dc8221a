"""``sparsebalance report RUN_DIR``: markdown + PNG report of one training run or several;
``--results-dir`` also writes the comparison as a dated results file (for figures you quote);
``--out`` writes the report elsewhere than the run folder (one you cannot write, say)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run folder (metrics.jsonl) or a folder of run folders")
    p.add_argument("--no-plots", action="store_true", help="markdown only")
    p.add_argument("--out", default=None, help="write report.md and the plots here (default: RUN_DIR)")
    p.add_argument(
        "--results-dir",
        default=None,
        help="also write <date>-<name>-<device>.md/.json there (e.g. benchmarks/results)",
    )
    p.add_argument("--name", default="train-report", help="results file name (with --results-dir)")
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")


def main(args: argparse.Namespace) -> int:
    from ..files import check_output_folder, unwritable
    from ..report import find_runs

    find_runs(Path(args.run_dir))  # not a run folder: one line, before anything is made
    out = Path(args.out) if args.out else Path(args.run_dir)
    if args.out:
        check_output_folder(out, "--out")
    reason = unwritable(out)
    if reason is not None:
        where = "--out" if args.out else "the run folder"
        raise ValueError(f"{where} {out} cannot be written ({reason}): pass --out DIR to write the report elsewhere")
    if args.results_dir:
        check_output_folder(args.results_dir, "--results-dir")
    try:
        comparison, wrote = _write(args, out)
    except PermissionError as err:  # a file in it not ours to replace (its folder was writable)
        raise ValueError(f"{err.filename}: {err.strerror}: pass --out DIR to write the report elsewhere") from None
    print(json.dumps(comparison, indent=2) if args.json else "\n".join(wrote))
    return 0


def _write(args: argparse.Namespace, out: Path) -> tuple[dict, list[str]]:
    """The report in ``out`` and, with ``--results-dir``, the results files; what was written."""
    import torch

    from ..report import table_note, write_report
    from ..results import portable_path, write_results

    path, comparison = write_report(args.run_dir, plots=not args.no_plots, out=out)
    wrote = [f"wrote {path}"]
    if args.results_dir:
        root = Path(args.run_dir)
        configs = {p.parent.name: _portable(json.loads(p.read_text())) for p in sorted(root.glob("**/config.json"))}
        table = path.read_text().split("\n\n")[1]
        device = torch.device("cuda" if any(c.get("device") == "cuda" for c in configs.values()) else "cpu")
        where = portable_path(str(root))  # not this machine's folders (issue 54)
        notes = f"Runs in `{where}` (their configurations are in the JSON file). " + table_note(comparison)
        md, js = write_results(
            args.results_dir, args.name, device, table, {"comparison": comparison, "configs": configs}, notes
        )
        comparison = {**comparison, "results_file": str(md), "results_json": str(js)}
        wrote.append(f"wrote {md} and {js.name}{_kept(md, args.name, device.type)}")
    return comparison, wrote


def _portable(value):
    """A run's configuration with every absolute path made portable (``--out``, ``--data``...)."""
    from ..results import portable_path

    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    return portable_path(value) if isinstance(value, str) and value.startswith("/") else value


def _kept(md: Path, name: str, device: str) -> str:
    """Why a results file has a suffix: today's file of that name exists and was kept."""
    first = md.with_name(f"{md.name[:10]}-{name}-{device}.md")  # <YYYY-MM-DD>-name-device
    return "" if first == md else f" ({first.name} exists from earlier today and is kept)"
