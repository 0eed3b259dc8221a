"""Issue 26, item 5 on CPU: nothing in the per-layer path of the flex backend reads a tensor's
values on the host. Run on ``meta`` tensors (shapes without values), any such read (``.item()``,
``int(t)``, ``bool(t.any())``, ``.tolist()``, ``.cpu()``) raises, as a CUDA sync would stall.
The real device check (``torch.cuda.set_sync_debug_mode("error")`` over a training step) is in
the gpu tier; block selection and DST's controller (issue 27) are not covered here."""

from __future__ import annotations

import torch

from sparsebalance.models.attention import LayerStats
from sparsebalance.ops import BlockLayout, Budget, random_layout
from sparsebalance.ops.block_sparse_flex import build_block_mask, nonfinite_reads, padded_length
from sparsebalance.ops.layout import dense_to_ordered
from sparsebalance.ops.varlen import check_cu_seqlens, check_qkv
from tests.conftest import cu_from_lengths


def _meta_layout() -> BlockLayout:
    cu = cu_from_lengths((100, 200, 217))
    lay = random_layout(cu, 2, 64, 0.5, seed=1)
    return BlockLayout(lay.kv_num_blocks, lay.kv_indices, cu, 517, 64, 4).to("meta")


def test_the_flex_layer_path_reads_no_value_on_the_host():
    layout = _meta_layout()
    q = torch.empty(517, 4, 16, device="meta")
    kv = torch.empty(517, 2, 16, device="meta")
    check_qkv(q, kv, kv)
    check_cu_seqlens(layout.cu_seqlens, 517)  # values are checked only where they are on the host
    layout.check_compatible(q, kv, layout.cu_seqlens)
    total = padded_length(layout, (4, 2, 16))
    mask = build_block_mask(layout, 4, torch.device("meta"), total=total)
    assert tuple(mask.kv_num_blocks.shape) == (1, 4, -(-total // 64))
    assert nonfinite_reads(kv.isnan(), layout, 4).shape == (517, 4, 16)
    stats = LayerStats.of(0, Budget(gamma=0.9), layout)  # densities stay on the device
    assert stats.density_tensor.device.type == "meta"
    assert stats.document_density_tensor.shape == (3,)


def test_dense_to_ordered_with_a_width_is_sort_free_and_host_free():
    mask = torch.rand(3, 9, 9, generator=torch.Generator().manual_seed(0)) < 0.4
    counts, idx = dense_to_ordered(mask, width=9)
    for h in range(3):
        for r in range(9):
            kept = torch.nonzero(mask[h, r]).flatten().tolist()
            assert counts[h, r] == len(kept)
            assert idx[h, r, : len(kept)].tolist() == kept and not idx[h, r, len(kept) :].any()
    meta_counts, meta_idx = dense_to_ordered(mask.to("meta"), width=9)
    assert meta_idx.shape == (3, 9, 9) and meta_counts.shape == (3, 9)
