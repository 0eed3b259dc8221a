"""Per-rank and per-ring-step compute imbalance of each context-parallel placement.

Computed from layouts (kept block pairs per rank and ring step), not timed: no GPU was available.
Grid: T = 32K and 128K, P = 8, B = 64, 4 layout heads, densities 1.0 / 0.3 / 0.1, a vertical-slash
and a random layout, one document and a pack of four (1/2, 1/4, 1/8, 1/8), plus the hierarchical
ring (G = 4) on the packed case. Writes ``benchmarks/results/<date>-ring-balance-cpu.{md,json}``.

    .venv/bin/python benchmarks/ring_balance.py [--quick]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sparsebalance.parallel.placement_study import COLUMNS, analyse
from sparsebalance.results import markdown_table, write_results

DENSITIES = [1.0, 0.3, 0.1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 32K only")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    seq_lens = [32768] if args.quick else [32768, 131072]
    world, rows = 8, []
    for total in seq_lens:
        for pattern in ("vslash", "random"):
            for docs in (1, 4):
                for inner in (None, 4) if docs == 4 else (None,):
                    for r in analyse(
                        total,
                        world,
                        DENSITIES,
                        ["contiguous", "zigzag", "striped"],
                        pattern,
                        docs,
                        block_size=64,
                        inner_size=inner,
                    ):
                        rows.append({"seq_len": total, "world": world, "inner_size": inner, **r})
    headers = [
        "T",
        "pattern",
        "docs",
        "G",
        "density",
        "layout",
        "rank",
        "ring",
        "lockstep",
        "lightest step",
        "heaviest step",
    ]
    body = [
        [
            r["seq_len"],
            r["pattern"],
            r["docs"],
            r["inner_size"] or "-",
            r["density"],
            r["layout"],
            *(r[c] for c in COLUMNS),
        ]
        for r in rows
    ]
    table = markdown_table(headers, body)
    notes = (
        "Computed, not measured: kept (query block, key block) pairs per rank and ring step of "
        "synthetic layouts (`sparsebalance.parallel.ring_work`), P = 8, B = 64, 4 heads. "
        "rank = max/mean per-rank work; ring = finish time when each rank waits only for its "
        "transfer partners (transfers free), over the ideal; lockstep = every step waits for the "
        "slowest rank; lightest/heaviest step = per-step max work over the mean step. "
        "No GPU timing: none was available."
    )
    md, js = write_results(args.out, "ring-balance", torch.device("cpu"), table, {"rows": rows}, notes)
    print(table)
    print(f"\nwrote {md} and {js}")


if __name__ == "__main__":
    main()
