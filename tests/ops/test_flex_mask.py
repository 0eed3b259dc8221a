"""Issue 36, items 2-4 on CPU: the flex ``BlockMask`` built straight from the layout's bool mask
(query-side lists included) equals what ``BlockMask.from_kv_blocks`` derives from the same kv-side
lists; the compiled flex forward with K/V expanded or flex's own GQA, and with runs of dense
documents routed to the dense kernel, equals the reference. Forward + backward on CUDA: gpu tier."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.ops import (
    BlockLayout,
    Budget,
    block_sparse_attention,
    random_layout,
    select_blocks,
)
from sparsebalance.ops.block_sparse_flex import flex_block_sparse_attention, padded_length
from sparsebalance.ops.flex_mask import build_block_mask, whole_block_runs
from sparsebalance.ops.pack_index import PackIndex
from tests.conftest import cu_from_lengths, make_qkv


def _valid(num, idx):
    """Per row, the first ``num`` indices (what the kernel reads) as Python lists."""
    rows = zip(idx.flatten(0, -2), num.flatten().tolist(), strict=True)
    return [row[:n].tolist() for row, n in rows]


@pytest.mark.parametrize(
    "lengths, heads, block, density",
    [
        pytest.param((130, 270, 600), 4, 64, 0.4, id="3docs-off-boundaries"),
        pytest.param((1000,), 2, 128, 0.2, id="1doc-B128"),
        pytest.param((45, 3, 80, 30, 500), 6, 32, 0.6, id="5docs-short"),
        pytest.param((2, 700), 4, 64, 1.0, id="dense"),
    ],
)
def test_query_side_lists_equal_from_kv_blocks(lengths, heads, block, density):
    from torch.nn.attention.flex_attention import BlockMask

    cu = cu_from_lengths(lengths)
    layout = random_layout(cu, heads, block, density, seed=3)
    total = padded_length(layout, (heads, heads, 16))
    ours = build_block_mask(layout, heads, total)
    theirs = BlockMask.from_kv_blocks(
        ours.kv_num_blocks,
        ours.kv_indices,
        ours.full_kv_num_blocks,
        ours.full_kv_indices,
        BLOCK_SIZE=block,
        mask_mod=ours.mask_mod,
        seq_lengths=(total, total),
    )
    for side in ("q", "full_q"):
        num, idx = f"{side}_num_blocks", f"{side}_indices"
        assert torch.equal(getattr(ours, num), getattr(theirs, num))
        assert _valid(getattr(ours, num), getattr(ours, idx)) == _valid(getattr(theirs, num), getattr(theirs, idx))
    # every list starts 16-byte aligned (Inductor copies a misaligned kernel input per call)
    for side in ("kv", "full_kv", "q", "full_q"):
        for part in ("num_blocks", "indices"):
            tensor = getattr(ours, f"{side}_{part}")
            assert tensor.data_ptr() % 16 == 0 and tensor.is_contiguous(), (side, part)
    # partial + full = the layout's doc-causal pairs, nothing else
    kept = ours.to_dense()[0].bool()[:, : layout.num_blocks, : layout.num_blocks]
    causal = layout.pack.causal_block_mask()
    assert torch.equal(kept, layout.block_mask & causal[None])


def test_dense_runs_are_the_runs_holding_a_whole_query_block():
    pack = PackIndex.build(cu_from_lengths((100, 30, 300, 40, 20, 200)), 64)
    dense = (True, True, False, True, True, True)
    assert pack.dense_runs(dense) == ((0, 2, 0, 130), (3, 6, 430, 690))
    assert whole_block_runs(pack, dense) == ((0, 2, 0, 130), (3, 6, 430, 690))
    assert whole_block_runs(pack, (False, True, False, True, True, False)) == ()  # < a block


@pytest.fixture
def fresh_dynamo():
    # CPU flex: a fresh compile cache per configuration; after another configuration, torch
    # 2.13's CPU inductor recompiles flex with C++ that does not build (see test_flex.py)
    torch._dynamo.reset()


@pytest.mark.parametrize("gqa", ["expand", "native"])
@pytest.mark.parametrize(
    "lengths, top_k",
    [
        pytest.param((900, 60, 100, 700), 2, id="sparse-dense-dense-sparse"),
        pytest.param((130, 270, 600), 3, id="dense-dense-sparse"),
        pytest.param((517, 300), 1, id="all-sparse"),
    ],
)
def test_flex_forward_with_dense_runs_matches_the_reference(gqa, lengths, top_k, fresh_dynamo):
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(sum(lengths), 4, 2, 16, dtype=torch.float32, requires_grad=False, seed=5)
    layout = select_blocks(q, k, cu, Budget(top_k=top_k), block_size=64)
    with torch.no_grad():  # CPU flex: forward only
        out = flex_block_sparse_attention(q, k, v, layout, 0.25, gqa=gqa)
    ref = block_sparse_attention(q, k, v, layout, cu, scale=0.25, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_layouts_without_known_dense_documents_run_everything_through_flex(fresh_dynamo):
    cu = cu_from_lengths((300, 200))
    q, k, v = make_qkv(500, 4, 2, 16, dtype=torch.float32, requires_grad=False, seed=6)
    full = select_blocks(q, k, cu, Budget(gamma=1.0), block_size=64)
    assert full.dense_docs == (True, True)
    plain = BlockLayout(full.block_mask, full.pack, 4)  # same pairs, dense documents unknown
    with torch.no_grad():
        a = flex_block_sparse_attention(q, k, v, plain, 0.25)
        b = flex_block_sparse_attention(q, k, v, full, 0.25)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
