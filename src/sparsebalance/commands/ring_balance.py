"""``sparsebalance ring-balance``: per-rank and per-ring-step work imbalance of each placement.

For a synthetic layout (``vslash``: vertical-slash lines, the structure of real dynamic sparse
attention; ``random``: random kept blocks) at each density, counts the kept block pairs every rank
computes at every ring step (:func:`sparsebalance.parallel.ring_work`) for the ``contiguous``,
``zigzag`` and ``striped`` placements, and prints the ratios of
:func:`sparsebalance.parallel.imbalance` (1.0 is perfect). Computed from layouts, not timed.
"""

from __future__ import annotations

import argparse
import json

from ..engine.kernel import add_block_size_argument, local_device, resolve_block_size
from ..parallel import PLACEMENTS
from ..parallel.placement_study import COLUMNS, PATTERNS, analyse
from ..results import markdown_table
from ..sizes import LAYOUT_BYTES_PER_PAIR, check_document_length, check_memory


def _size(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",")]


def format_table(rows: list[dict]) -> str:
    headers = [
        "density",
        "layout",
        "rank max/mean",
        "ring / ideal",
        "lockstep / ideal",
        "lightest step",
        "heaviest step",
    ]
    body = [[r["density"], r["layout"], *(r[c] for c in COLUMNS)] for r in rows]
    return markdown_table(headers, body)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=_size, default=32768, help="T in tokens (e.g. 32k)")
    p.add_argument("--world", type=int, default=8, help="context-parallel ranks P")
    p.add_argument("--density", type=_floats, default=[1.0, 0.3, 0.1], help="e.g. 1,0.3,0.1")
    p.add_argument("--layout", default="all", help=f"all, or a comma list of {', '.join(PLACEMENTS)}")
    p.add_argument("--pattern", default="vslash", help=f"one of {', '.join(PATTERNS)}")
    p.add_argument("--docs", type=int, default=1, help="documents in the pack (halving lengths)")
    add_block_size_argument(p, "sparse block in tokens (default: this machine's device's, 128 on CUDA, 64 on CPU)")
    p.add_argument("--heads", type=int, default=4, help="layout heads")
    p.add_argument("--inner-size", type=int, default=None, help="G of a hierarchical ring")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic layout")
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")


def main(args: argparse.Namespace) -> int:
    layouts = list(PLACEMENTS) if args.layout == "all" else args.layout.split(",")
    for kind in layouts:
        if kind not in PLACEMENTS:
            raise ValueError(f"--layout must be all or from {', '.join(PLACEMENTS)}, got {kind!r}")
    if args.world <= 0:
        raise ValueError(f"--world must be >= 1, got {args.world}")
    if args.inner_size is not None and (args.inner_size <= 0 or args.world % args.inner_size):
        raise ValueError(f"--inner-size must divide --world ({args.world}), got {args.inner_size}")
    # a layout analysis: no kernel compiles, so any positive block is accepted
    args.block_size = resolve_block_size(local_device(), args.block_size, backend=None)
    for flag, value in (("--seq-len", args.seq_len), ("--heads", args.heads)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_document_length("--seq-len", args.seq_len)
    blocks = -(-args.seq_len // args.block_size)
    check_memory(
        "--seq-len / --block-size / --heads",
        f"{args.heads} synthetic layouts of {blocks:,} x {blocks:,} blocks",
        LAYOUT_BYTES_PER_PAIR * args.heads * blocks * blocks,
    )
    rows = analyse(
        args.seq_len,
        args.world,
        args.density,
        layouts,
        args.pattern,
        args.docs,
        block_size=args.block_size,
        heads=args.heads,
        inner_size=args.inner_size,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    print(
        f"T={args.seq_len} P={args.world} B={args.block_size} pattern={args.pattern} "
        f"docs={args.docs}" + (f" inner={args.inner_size}" if args.inner_size else "")
    )
    print(format_table(rows))
    print(
        "rank: max/mean of per-rank work; ring: finish time with each rank waiting only for its "
        "transfer partners; lockstep: every step waits for the slowest rank; lightest/heaviest "
        "step: per-step max work over the mean step (a light step cannot hide its transfer). "
        "Computed from layouts (kept block pairs), not timed."
    )
    return 0
