"""The ring imbalance of a placement on an *estimated* layout: what
:class:`~sparsebalance.latency.context.ContextCost` multiplies a split document's attention by
(instead of its calibrated default) when the pattern is known.
"""

from __future__ import annotations

import torch

from .layouts import imbalance, make_placement, ring_work
from .patterns import vertical_slash_layout


def estimate_ring_imbalance(
    seq_len: int,
    density: float,
    degree: int,
    placement: str = "striped",
    *,
    block_size: int,
    inner_size: int | None = None,
    num_heads: int = 2,
    seed: int = 0,
) -> float:
    """``imbalance(ring_work(layout, placement))["ring"]`` on a vertical-slash layout of one
    document (an estimated layout: the pattern MInference / MTraining report). Costs one
    ``(heads, nb, nb)`` block mask: keep ``seq_len / block_size`` to a few thousand."""
    cu = torch.tensor([0, seq_len], dtype=torch.int32)
    layout = vertical_slash_layout(cu, num_heads, block_size, density, seed=seed)
    pl = make_placement(placement, seq_len, block_size, degree)
    return float(imbalance(ring_work(layout, pl, inner_size), inner_size)["ring"])
