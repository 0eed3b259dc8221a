"""BlockLayout: construction, token mask against a brute-force definition, densities."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.ops import BlockLayout, causal_block_mask
from tests.conftest import cu_from_lengths


def brute_force_mask(block_mask, lengths, block_size, hq):
    """Independent spelling of to_mask: loops over tokens."""
    total = sum(lengths)
    doc = [d for d, n in enumerate(lengths) for _ in range(n)]
    out = torch.zeros(hq, total, total, dtype=torch.bool)
    group = hq // block_mask.shape[0]
    for h in range(hq):
        for i in range(total):
            for j in range(i + 1):
                if doc[i] == doc[j] and block_mask[h // group, i // block_size, j // block_size]:
                    out[h, i, j] = True
    return out


@pytest.mark.parametrize(
    "lengths,block_size,layout_heads,hq",
    [((37,), 8, 2, 2), ((5, 30, 1, 12), 8, 2, 4), ((16, 16), 8, 1, 3), ((1,), 4, 1, 1)],
    ids=["one-doc", "unaligned-docs-shared", "aligned", "T1"],
)
def test_to_mask_matches_brute_force(lengths, block_size, layout_heads, hq):
    cu = cu_from_lengths(lengths)
    total = sum(lengths)
    nb = -(-total // block_size)
    g = torch.Generator().manual_seed(3)
    # Random block masks, including non-causal pairs and missing diagonals.
    bm = torch.rand(layout_heads, nb, nb, generator=g) < 0.5
    layout = BlockLayout.from_block_mask(bm, cu, block_size, hq)
    assert torch.equal(layout.to_block_mask(), bm)
    assert torch.equal(layout.to_mask(cu), brute_force_mask(bm, lengths, block_size, hq))


def test_indices_sorted_and_counts():
    cu = cu_from_lengths([40])
    bm = torch.zeros(1, 5, 5, dtype=torch.bool)
    bm[0, 4, [3, 0, 4]] = True
    layout = BlockLayout.from_block_mask(bm, cu, 8, 1)
    assert layout.kv_num_blocks.tolist() == [[0, 0, 0, 0, 3]]
    assert layout.kv_indices[0, 4, :3].tolist() == [0, 3, 4]
    assert layout.kv_num_blocks.dtype == torch.int32


def test_causal_block_mask_is_contiguous_range_per_document():
    # docs [0,10) [10,30) with B=8: block 1 holds tokens 8..15 (both docs) -> sees blocks 0..1;
    # block 2 (16..23) lies in doc 2, which starts at token 10 (block 1) -> sees blocks 1..2.
    cu = cu_from_lengths([10, 20])
    cm = causal_block_mask(cu, 30, 8)
    assert cm.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, True, True, False],
        [False, True, True, True],
    ]


def test_density_counts_only_causal_pairs():
    cu = cu_from_lengths([32])
    full = torch.ones(2, 4, 4, dtype=torch.bool)  # includes the upper triangle
    layout = BlockLayout.from_block_mask(full, cu, 8, 2)
    assert layout.density() == pytest.approx(1.0)
    diag = torch.eye(4, dtype=torch.bool).expand(2, 4, 4).clone()
    diag[1] = causal_block_mask(cu, 32, 8)
    layout = BlockLayout.from_block_mask(diag, cu, 8, 2)
    assert layout.head_density().tolist() == pytest.approx([4 / 10, 1.0])
    assert layout.density() == pytest.approx(14 / 20)
    assert layout.num_kept_pairs() == 14


def test_document_density_separates_documents():
    cu = cu_from_lengths([16, 16])  # blocks 0-1 doc 0, blocks 2-3 doc 1 (aligned)
    bm = causal_block_mask(cu, 32, 8)[None].clone()
    bm[0, 3, 2] = False  # drop one of doc 1's three pairs
    layout = BlockLayout.from_block_mask(bm, cu, 8, 1)
    assert layout.document_density().tolist() == pytest.approx([1.0, 2 / 3])


def test_from_block_mask_rejects_wrong_shapes():
    cu = cu_from_lengths([30])
    with pytest.raises(ValueError, match="block_mask must be"):
        BlockLayout.from_block_mask(torch.ones(1, 3, 3, dtype=torch.bool), cu, 8, 1)
    with pytest.raises(ValueError, match="bool"):
        BlockLayout.from_block_mask(torch.ones(1, 4, 4), cu, 8, 1)
    with pytest.raises(ValueError, match="divide"):
        BlockLayout.from_block_mask(torch.ones(2, 4, 4, dtype=torch.bool), cu, 8, 3)


def test_random_layout_hits_per_document_density():
    from sparsebalance.ops import random_layout

    cu = cu_from_lengths([2048, 1024, 64])
    layout = random_layout(cu, 2, 32, [0.1, 0.5, 1.0], seed=0)
    dd = layout.document_density()
    assert abs(float(dd[0]) - 0.1) < 0.03 and abs(float(dd[1]) - 0.5) < 0.05
    assert float(dd[2]) == pytest.approx(1.0)
    bm = layout.to_block_mask()
    assert bool(bm[:, torch.arange(98), torch.arange(98)].all()), "diagonal always kept"
    with pytest.raises(ValueError, match="density"):
        random_layout(cu, 2, 32, [0.5, 0.0, 1.0])
