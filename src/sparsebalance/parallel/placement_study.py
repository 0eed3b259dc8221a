"""Placement studies: how evenly each context-parallel placement spreads the kept block pairs of a
synthetic layout over ranks and ring steps (what ``sparsebalance ring-balance`` and
``benchmarks/ring_balance.py`` print). Computed from layouts, not timed."""

from __future__ import annotations

import torch

from ..ops import random_layout
from .layouts import imbalance, make_placement, ring_work
from .patterns import vertical_slash_layout

PATTERNS = ("vslash", "random")
"""Synthetic layouts: vertical-slash lines (real dynamic sparse attention's shape) or random."""
COLUMNS = ("rank", "ring", "lockstep", "step_min", "step_max")
"""The ratios of :func:`~sparsebalance.parallel.imbalance` in each row (1.0 is perfect)."""


def document_lengths(seq_len: int, num_docs: int) -> list[int]:
    """``num_docs`` documents halving in length (1/2, 1/4, ..., last two equal), summing to T."""
    if not 1 <= num_docs <= seq_len:
        raise ValueError(f"--docs must be in [1, --seq-len], got {num_docs}")
    lengths, left = [], seq_len
    for _ in range(num_docs - 1):
        lengths.append(max(1, left // 2))
        left -= lengths[-1]
    return [*lengths, left]


def analyse(
    seq_len: int,
    world: int,
    densities: list[float],
    layouts: list[str],
    pattern: str = "vslash",
    num_docs: int = 1,
    *,
    block_size: int,
    heads: int = 4,
    inner_size: int | None = None,
    seed: int = 0,
) -> list[dict]:
    """One row per (density, placement): the imbalance ratios, per-rank totals, per-step maxima."""
    if pattern not in PATTERNS:
        raise ValueError(f"--pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
    lengths = document_lengths(seq_len, num_docs)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    rows = []
    for density in densities:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"--density values must be in (0, 1], got {density}")
        if pattern == "vslash":
            layout = vertical_slash_layout(cu, heads, block_size, density, seed=seed)
        else:
            layout = random_layout(cu, heads, block_size, density, seed=seed)
        for kind in layouts:
            work = ring_work(layout, make_placement(kind, seq_len, block_size, world), inner_size)
            rows.append(
                {
                    "pattern": pattern,
                    "docs": num_docs,
                    "target_density": density,
                    "density": round(layout.density(), 4),
                    "layout": kind,
                    **imbalance(work, inner_size),
                    "rank_work": work.sum(1).tolist(),
                    "step_max_work": work.max(0).values.tolist(),
                }
            )
    return rows
