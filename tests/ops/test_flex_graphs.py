"""Issue 26, items 5-6 on CPU's compiled flex forward: a bounded number of graphs over many packed
lengths (dynamic shapes, short packs padded, no size collisions), and non-finite values marked
exactly without a host sync or a second attention call. Forward + backward on CUDA: gpu tier."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from sparsebalance.ops import BlockLayout, block_sparse_attention, random_layout
from sparsebalance.ops.block_sparse_flex import flex_block_sparse_attention, nonfinite_reads
from tests.conftest import cu_from_lengths, make_qkv

# 10 packed lengths: a 2-token filler, packs shorter than a block, exact multiples of it, and
# T = 1000 whose 16 blocks equal the head dim (a size Dynamo would otherwise share a symbol with).
LENGTHS = (1000, 2, 50, 128, 300, 517, 700, 1024, 1500, 2100)


def _layout(
    total: int, hq: int, hl: int, block: int, seed: int
) -> tuple[torch.Tensor, BlockLayout]:
    cu = cu_from_lengths((total,) if total < 4 else (total // 3, total - total // 3))
    lay = random_layout(cu, hl, block, 0.5, seed=seed)
    return cu, BlockLayout(lay.kv_num_blocks, lay.kv_indices, cu, total, block, hq)


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


@pytest.mark.parametrize(
    "lengths, hq, hkv, hl",
    [
        pytest.param((130, 270, 600), 4, 2, 4, id="3docs-GQA2-perhead"),
        pytest.param((40, 88), 4, 2, 2, id="2docs-GQA2-perkvhead"),
        pytest.param((45, 3, 80, 30), 4, 2, 4, id="4docs-short"),
        pytest.param((7, 90, 33, 200), 6, 2, 2, id="4docs-GQA3"),
        pytest.param((97,), 4, 4, 4, id="1doc-MHA"),
    ],
)
def test_nonfinite_reads_are_exactly_the_reference_nan_outputs(lengths, hq, hkv, hl):
    """Device work only (prefix counts), same pattern as the reference's NaN/inf outputs."""
    cu = cu_from_lengths(lengths)
    total = sum(lengths)
    q, k, v = make_qkv(total, hq, hkv, 8, requires_grad=False, seed=len(lengths))
    _, layout = _layout(total, hq, hl, 16, seed=hq)
    layout = BlockLayout(layout.kv_num_blocks, layout.kv_indices, cu, total, 16, hq)
    g = torch.Generator().manual_seed(1)
    where = torch.randint(0, total, (5,), generator=g)
    v[where, torch.randint(0, hkv, (5,), generator=g), torch.randint(0, 8, (5,), generator=g)] = (
        math.nan
    )
    v[where[0], 0, 1] = math.inf
    ref = block_sparse_attention(q, k, v, layout, cu, backend="reference")
    reads = nonfinite_reads(~torch.isfinite(v), layout, hq)
    assert bool(reads.any())
    assert torch.equal(reads, ~torch.isfinite(ref))


@pytest.fixture(scope="module")
def fresh_dynamo():
    torch._dynamo.reset()  # CPU flex: one configuration per compile cache (see test_flex.py)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_flex_forward_marks_nan_exactly_with_gqa_and_documents_off_block_boundaries(
    where, fresh_dynamo
):
    lengths = (130, 270, 600)
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(1000, 4, 2, 16, dtype=torch.float32, requires_grad=False, seed=2)
    _, layout = _layout(1000, 4, 4, 64, 3)
    layout = BlockLayout(layout.kv_num_blocks, layout.kv_indices, cu, 1000, 64, 4)
    x = {"q": q, "k": k, "v": v}[where]
    x[[140, 700], 1, 3] = math.nan  # document 2 (off a block boundary) and document 3
    out = flex_block_sparse_attention(q, k, v, layout, 16**-0.5)
    ref = block_sparse_attention(q, k, v, layout, cu, backend="reference")
    assert torch.equal(out.isnan(), ref.isnan()) and bool(torch.isfinite(out[:130]).all())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
