"""The dense-path crossover: from which density one document's attention is faster on the dense
kernel (FlashAttention varlen, every causal block) than on the sparse one (flex, the kept blocks).

On an H100 (2026-11-26, ``../shared/gpu/README.md``) flex at 32K tokens cost 3.5 ms at density
0.05 against 15.5 ms for dense SDPA: ~4.5x SDPA's time per kept pair, so documents well below
density 1 are already cheaper dense. Where exactly depends on the GPU, the heads, the length and
the kernels' versions, so it is measured, once per latency profile on CUDA for top-k budgets
(:func:`measure_dense_crossover`), and recorded as ``Profile.dense_from``: a run then promotes
a top-k document whose density reaches it to exact attention on the dense kernel
(:meth:`~sparsebalance.ops.Budget.dense_documents`), and the profile's attention table is flat
from it (what such a document costs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..models import ModelShapes
from ..ops import BlockLayout, block_sparse_attention, random_layout
from ..ops.dense import dense_attention

DENSITIES = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0)
"""Densities the sparse kernel is timed at."""
REFERENCE_TOKENS = 16384
"""The document length timed (or the profile's longest micro-batch, if shorter)."""


def crossover_from_times(
    densities: Sequence[float], sparse_seconds: Sequence[float], dense_seconds: float
) -> float | None:
    """The density at which the sparse kernel's time first reaches the dense kernel's,
    interpolated linearly between the timed densities (ascending); the lowest timed density if
    the sparse kernel is slower there already; None if it stays faster up to the last one (no
    document would be faster dense)."""
    d = np.asarray(densities, float)
    s = np.asarray(sparse_seconds, float)
    if d.size == 0 or d.shape != s.shape or np.any(np.diff(d) <= 0):
        raise ValueError("densities must be ascending and match the times")
    if not (np.all(np.isfinite(s) & (s > 0)) and np.isfinite(dense_seconds) and dense_seconds > 0):
        raise ValueError("times must be finite and > 0")
    above = np.flatnonzero(s >= dense_seconds)
    if above.size == 0:
        return None
    i = int(above[0])
    if i == 0:
        return float(d[0])
    frac = (dense_seconds - s[i - 1]) / (s[i] - s[i - 1])
    return float(round(d[i - 1] + frac * (d[i] - d[i - 1]), 4))


def measure_dense_crossover(
    shapes: ModelShapes,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_len: int,
    timer: Callable[[Callable[[], object]], float],
    backend: str = "flex",
) -> float | None:
    """:func:`crossover_from_times` of one document of ``min(max_len, 16K)`` tokens with the
    model's heads: forward + backward of the sparse op at each of :data:`DENSITIES` (top-k
    layouts, every document forced onto the sparse kernel) and of the dense kernel, each timed
    by ``timer`` (``fn -> seconds``: warm-up and median)."""
    total = max(8 * block_size, min(max_len, REFERENCE_TOKENS) // block_size * block_size)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(total, h, shapes.head_dim, generator=g).to(device, dtype).requires_grad_()
        for h in (shapes.num_heads, shapes.num_kv_heads, shapes.num_kv_heads)
    )
    grad = torch.randn(total, shapes.num_heads, shapes.head_dim, generator=g).to(device, dtype)
    cu = torch.tensor([0, total], dtype=torch.int32)
    scale = shapes.head_dim**-0.5

    def dense() -> None:
        dense_attention(q, k, v, cu.to(device), (total,), scale).backward(grad)

    sparse = []
    for density in DENSITIES:
        drawn = random_layout(cu, shapes.num_heads, block_size, density, seed=1, shape="top-k")
        layout = BlockLayout(drawn.block_mask, drawn.pack, shapes.num_heads).to(device)  # sparse

        def run(layout=layout) -> None:
            block_sparse_attention(q, k, v, layout, layout.cu_seqlens, scale=scale, backend=backend).backward(grad)

        sparse.append(timer(run))
    return crossover_from_times(DENSITIES, sparse, timer(dense))
