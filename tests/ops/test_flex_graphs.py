"""Issue 26, item 6 on CPU's compiled flex forward: a bounded number of graphs over many packed
lengths (dynamic shapes, short packs padded, no size collisions). Forward + backward on CUDA:
gpu tier."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from sparsebalance.ops import BlockLayout, random_layout
from sparsebalance.ops.block_sparse_flex import flex_block_sparse_attention
from tests.conftest import cu_from_lengths

# 10 packed lengths: a 2-token filler, packs shorter than a block, exact multiples of it, and
# T = 1000 whose 16 blocks equal the head dim (a size Dynamo would otherwise share a symbol with).
LENGTHS = (1000, 2, 50, 128, 300, 517, 700, 1024, 1500, 2100)


def _layout(total: int, hq: int, hl: int, block: int, seed: int) -> tuple[torch.Tensor, BlockLayout]:
    cu = cu_from_lengths((total,) if total < 4 else (total // 3, total - total // 3))
    lay = random_layout(cu, hl, block, 0.5, seed=seed)
    return cu, BlockLayout(lay.block_mask, lay.pack, hq)


@pytest.mark.parametrize("dtype", [torch.float32])
def test_ten_packed_lengths_compile_at_most_two_graphs(dtype):
    """The review's defect 7: one graph per length (or an eager fallback past the recompile
    limit) instead of one dynamic graph. Fails with a static compile (10 graphs) or without
    the padding of short packs (a second, specialised graph that does not even build on CPU)."""
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    for i, total in enumerate(LENGTHS):
        _, layout = _layout(total, 4, 2, 64, i)
        q, k, v = (torch.randn(total, h, 16, generator=g).to(dtype) for h in (4, 2, 2))
        with torch.no_grad():  # CPU flex is forward-only
            out = flex_block_sparse_attention(q, k, v, layout, 0.25)
        assert out.shape == (total, 4, 16) and bool(torch.isfinite(out).all())
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
