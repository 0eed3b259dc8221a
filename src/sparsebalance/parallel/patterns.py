"""Synthetic sparse layouts with the structure real dynamic sparse attention shows.

:func:`vertical_slash_layout` is the MInference / MTraining "vertical-slash" pattern at block
granularity: attention concentrates on a few *slash* lines (fixed query-key offsets, strongest
near the diagonal) and a few *vertical* lines (key blocks every later query reads, like the
document's first block, the attention sink). It is what makes the zigzag placement unbalanced
under sparsity: the diagonal band stays on each rank's own shard (ring step 0) and the vertical
lines live on whichever rank holds them. Used by the imbalance analysis, the ``ring-balance``
command and the tests; random layouts are :func:`sparsebalance.ops.random_layout`.
"""

from __future__ import annotations

import torch

from ..ops.layout import BlockLayout, layout_from_priorities, num_blocks
from ..ops.varlen import check_cu_seqlens


def vertical_slash_layout(
    cu_seqlens: torch.Tensor,
    num_heads: int,
    block_size: int,
    density: float,
    num_slash: int = 4,
    num_vertical: int = 4,
    seed: int = 0,
) -> BlockLayout:
    """A vertical-slash layout keeping ``max(1, round(density * causal blocks))`` per query block.

    Per head, key block ``kb`` of query block ``qb`` is ranked by: the diagonal, the document's
    first block (sink), then ``max(slash[qb - kb], vertical[kb])`` where ``slash`` decays with the
    offset (``exp(-offset / 2)``) plus ``num_slash`` random offsets of weight in [0.5, 1), and
    ``vertical`` is ``num_vertical`` random key blocks of weight in [0.5, 1); a small random term
    breaks ties (and fills rows once the lines are used up, at high density).

    Args:
        cu_seqlens: int32 ``(N + 1,)`` document offsets.
        num_heads: layout heads H.
        block_size: tokens per block B.
        density: target fraction of each query block's causal key blocks, in (0, 1].
        num_slash: random slash offsets per head (besides the decaying diagonal band).
        num_vertical: random vertical key blocks per head.
        seed: random seed.

    Returns:
        A :class:`BlockLayout` with ``num_heads`` heads (``num_q_heads = num_heads``).
    """
    check_cu_seqlens(cu_seqlens)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if num_slash < 0 or num_vertical < 0:
        raise ValueError("num_slash and num_vertical must be >= 0")
    total = int(cu_seqlens[-1])
    nb = num_blocks(total, block_size)
    cu = cu_seqlens.to("cpu", torch.int64)
    gen = torch.Generator().manual_seed(seed)
    qb = torch.arange(nb)
    offset = (qb[:, None] - qb[None, :]).clamp_min(0)  # (nb, nb)

    slash = torch.exp(-torch.arange(nb, dtype=torch.float64) / 2).repeat(num_heads, 1)
    vertical = torch.zeros(num_heads, nb, dtype=torch.float64)
    for h in range(num_heads):
        picks = torch.randint(0, nb, (num_slash + num_vertical,), generator=gen)
        weights = 0.5 + 0.5 * torch.rand(num_slash + num_vertical, generator=gen, dtype=torch.float64)
        slash[h, picks[:num_slash]] = torch.maximum(slash[h, picks[:num_slash]], weights[:num_slash])
        vertical[h, picks[num_slash:]] = weights[num_slash:]
    prio = torch.maximum(slash[:, offset], vertical[:, None, :])  # (H, nb, nb)
    prio += 1e-3 * torch.rand(prio.shape, generator=gen, dtype=torch.float64)
    return layout_from_priorities(prio, cu, block_size, density)
