"""Partial attention (local query blocks x one key shard) merged by log-sum-exp over any
partition of the key blocks equals the single-device op, in float64. No processes."""

from __future__ import annotations

import math

import pytest
import torch

from sparsebalance.ops import Budget, block_sparse_attention, random_layout, select_blocks
from sparsebalance.parallel import make_placement, partial_attention

from ..conftest import cu_from_lengths, make_qkv


def _merge(parts):
    out, lse = parts[0]
    for o, l in parts[1:]:
        new = torch.logaddexp(lse, l)
        seen = new > -math.inf
        w_old = torch.where(seen, (lse - new).exp(), 0.0)[..., None]
        w_new = torch.where(seen, (l - new).exp(), 0.0)[..., None]
        out, lse = out * w_old + o * w_new, new
    return out, lse


@pytest.mark.parametrize(
    "lengths,hq,hkv,block,gamma",
    [
        pytest.param((97,), 2, 2, 16, 1.0, id="T97-dense"),
        pytest.param((50, 1, 79, 73), 4, 2, 16, 0.7, id="T203-4docs-GQA2"),
        pytest.param((200, 25), 4, 1, 32, "random", id="T225-GQA4-random"),
    ],
)
@pytest.mark.parametrize("kind", ["striped", "zigzag"])
def test_partial_attention_over_shards_merges_to_the_op(lengths, hq, hkv, block, gamma, kind):
    cu = cu_from_lengths(lengths)
    total = int(cu[-1])
    q, k, v = make_qkv(total, hq, hkv, 16, requires_grad=False)
    if gamma == "random":
        layout = random_layout(cu, hq, block, 0.3, seed=1)
    else:
        layout = select_blocks(q, k, cu, Budget(gamma=gamma), block)
    want = block_sparse_attention(q, k, v, layout, cu, backend="reference")

    placement = make_placement(kind, total, block, 3)
    rows = []
    for r in range(3):  # queries of rank r against every shard, then merged
        ql = placement.shard(q, r)
        parts = [
            partial_attention(
                ql,
                placement.shard(k, s),
                placement.shard(v, s),
                layout,
                placement.blocks[r],
                placement.blocks[s],
            )
            for s in range(3)
        ]
        out, lse = _merge(parts)
        rows.append(out)
        assert out.dtype == torch.float64 and lse.shape == ql.shape[:2]
    got = placement.unshard(rows)
    assert float((got - want).abs().max()) <= 1e-12
