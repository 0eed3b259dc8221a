"""The flex backend. On CPU, compiled FlexAttention runs forward only, which still checks that the
BlockMask built from a layout (kept blocks, full/partial split, document-causal mask_mod) computes
exactly the reference pairs. Forward + backward on CUDA are in the ``gpu`` tier."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.ops import BlockLayout, Budget, block_sparse_attention, select_blocks
from sparsebalance.ops.flex_mask import build_block_mask
from tests.conftest import cu_from_lengths, make_qkv, rel_rms


def sparse_case(device="cpu", dtype=torch.float32, seed=0):
    lengths = (130, 270, 600)  # documents not on block boundaries
    cu = cu_from_lengths(lengths, device)
    q, k, v = make_qkv(sum(lengths), 4, 2, 64, dtype=dtype, device=device, seed=seed)
    nb = -(-sum(lengths) // 128)
    bm = torch.rand(4, nb, nb, generator=torch.Generator().manual_seed(seed)) < 0.5
    bm |= torch.eye(nb, dtype=torch.bool)
    return q, k, v, cu, BlockLayout.from_block_mask(bm.to(device), cu, 128, 4)


def test_flex_block_mask_forward_on_cpu_matches_reference():
    from torch.nn.attention.flex_attention import flex_attention

    # Dynamo caches flex per code object: a fresh start, whatever other CPU flex tests compiled
    # (torch 2.13's CPU inductor cannot build flex's C++ for some recompiles).
    torch._dynamo.reset()
    q, k, v, cu, layout = sparse_case()
    assert layout.density() < 0.8
    block_mask = build_block_mask(layout, 4, layout.seq_len)
    qt, kt, vt = (x.detach().transpose(0, 1)[None] for x in (q, k, v))
    out = torch.compile(flex_attention)(qt, kt, vt, block_mask=block_mask, enable_gqa=True)
    ref = block_sparse_attention(q, k, v, layout, cu, backend="reference")
    torch.testing.assert_close(out[0].transpose(0, 1), ref.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_flex_forward_backward_on_cuda(gamma):
    lengths = (1000, 3000, 96)
    cu = cu_from_lengths(lengths, "cuda")
    q, k, v = make_qkv(sum(lengths), 8, 2, 64, dtype=torch.float32, device="cuda")
    layout = select_blocks(q, k, cu, Budget(gamma=gamma), block_size=128)
    ref = block_sparse_attention(q, k, v, layout, cu, backend="reference")
    out = block_sparse_attention(q, k, v, layout, cu, backend="flex")
    assert rel_rms(out, ref) < 1e-3
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        assert rel_rms(a, b) < 1e-3


@pytest.mark.gpu
def test_torch_backend_on_cuda_matches_reference():
    q, k, v, cu, layout = sparse_case(device="cuda")
    ref = block_sparse_attention(q, k, v, layout, cu, backend="reference")
    out = block_sparse_attention(q, k, v, layout, cu, backend="torch")
    assert rel_rms(out, ref) < 1e-4
