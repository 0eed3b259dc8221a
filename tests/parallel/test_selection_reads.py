"""Issue 53, item 2: a CP unit's selection reads nothing back from the device in a layer. Which
segments each rank holds comes from the pack's host facts and the placement (uploaded once per
pack), so the distributed estimate (pooling, one all-gather, the estimator) is device work only,
and it equals the single-process estimate. The ring's own block-pair plan (``ops/block_pairs.py``)
still reads its kept counts once per layer and ring step: not done (it would need fixed-width
chunks)."""

from __future__ import annotations

import torch

from sparsebalance.launches import LaunchCounter
from sparsebalance.ops import Budget, select_blocks
from sparsebalance.ops.pack_index import PackIndex
from sparsebalance.parallel import estimate_block_mass_distributed, make_placement
from tests.conftest import cu_from_lengths, make_qkv

from .spawn import run_workers

BLOCK = 16
LENGTHS = (50, 1, 79, 73)


def _count_reads(rank, world):
    cu = cu_from_lengths(LENGTHS)
    q, k, _ = make_qkv(int(cu[-1]), 4, 2, 8, dtype=torch.float64, seed=1, requires_grad=False)
    placement = make_placement("striped", int(cu[-1]), BLOCK, world)
    ql, kl = (placement.shard(x, rank) for x in (q, k))
    pack = PackIndex.build(cu, BLOCK, LENGTHS)
    estimate_block_mass_distributed(None, ql, kl, placement, cu, pack=pack)  # the pack's tables, once
    with LaunchCounter(trace=True) as count:
        est = estimate_block_mass_distributed(None, ql, kl, placement, cu, pack=pack)
    assert not count.reads, (count.reads, count.read_sites)
    assert not count.constructor_copies, count.constructor_copies
    want = select_blocks(q, k, cu, Budget(gamma=0.8), BLOCK)
    assert torch.equal(est.layout(Budget(gamma=0.8)).block_mask, want.block_mask)


def test_a_cp_units_selection_reads_nothing_back(tmp_path):
    run_workers(_count_reads, 2, tmp_path)
