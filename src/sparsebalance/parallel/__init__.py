"""Context parallelism: block-sparse ring attention for documents longer than one device.

```python
placement = make_placement("striped", T, block_size, P)        # which blocks each rank holds
q, k, v = (placement.shard(x, rank) for x in (q_all, k_all, v_all))  # (Tl, H, D) per rank
layout = select_blocks_distributed(cp_group, q, k, placement, cu_seqlens, Budget(gamma=0.9))
out = ring_attention(cp_group, q, k, v, layout, placement)    # or hierarchical_ring_attention
# cp_group: a ProcessGroup, or RankList((2, 3, 4)): ranks of the default group, P2P, no new group
imbalance(ring_work(layout, placement))                         # per-rank / per-step balance
```
"""

from .blockwise import partial_attention
from .hierarchical import hierarchical_ring_attention
from .layouts import (
    PLACEMENTS,
    Placement,
    imbalance,
    make_placement,
    ring_sources,
    ring_work,
)
from .mesh import (
    MeshRanks,
    build_mesh,
    mesh_ranks,
)
from .patterns import vertical_slash_layout
from .ranks import RankList
from .ring import ring_attention
from .selection import estimate_block_mass_distributed, select_blocks_distributed

__all__ = [
    "PLACEMENTS",
    "MeshRanks",
    "Placement",
    "RankList",
    "build_mesh",
    "estimate_block_mass_distributed",
    "hierarchical_ring_attention",
    "imbalance",
    "make_placement",
    "mesh_ranks",
    "partial_attention",
    "ring_attention",
    "ring_sources",
    "ring_work",
    "select_blocks_distributed",
    "vertical_slash_layout",
]
