"""block_sparse_attention: every CPU backend against the reference (float64), forward and grads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import sparsebalance.ops.block_sparse_torch as bst
from sparsebalance.ops import BlockLayout, BlockPairs, Budget, block_sparse_attention, select_blocks
from tests.conftest import cu_from_lengths, make_qkv

CASES = [
    pytest.param((1,), 2, 2, 32, 64, id="T1-H2-G1-D32"),
    pytest.param((97,), 4, 2, 64, 64, id="T97-H4-G2-D64"),
    pytest.param((128,), 4, 1, 32, 64, id="T128-H4-G4-D32"),
    pytest.param((70, 130), 4, 4, 128, 64, id="T200-docs2-G1-D128"),
    pytest.param((300, 1, 600, 124), 4, 2, 64, 64, id="T1025-docs4-G2-D64"),
    pytest.param((333, 692), 8, 2, 32, 128, id="T1025-docs2-G4-B128"),
]


def per_document_causal(q, k, v, lengths):
    """Dense causal attention document by document (independent of the layout machinery)."""
    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        sl = slice(start, start + n)
        qd = q[sl].transpose(0, 1)
        kd = k[sl].repeat_interleave(group, 1).transpose(0, 1)
        vd = v[sl].repeat_interleave(group, 1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(outs)


def grads(out, inputs, seed=7):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.fixture
def poisoned(monkeypatch):
    """Output buffers start as NaN: any element a backend forgets to write fails the comparison."""
    monkeypatch.setattr(
        bst,
        "_new_output",
        lambda shape, dtype, device: torch.full(shape, math.nan, dtype=dtype, device=device),
    )


@pytest.mark.parametrize("lengths,hq,hkv,dim,bs", CASES)
@pytest.mark.parametrize("share", [False, True], ids=["per-head", "shared-kv"])
@pytest.mark.parametrize("gamma", [1.0, 0.6, 0.2])
def test_torch_matches_reference_float64(lengths, hq, hkv, dim, bs, share, gamma, poisoned):
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(sum(lengths), hq, hkv, dim)
    layout = select_blocks(q, k, cu, Budget(gamma=gamma), block_size=bs, share_kv_groups=share)
    ref = block_sparse_attention(q, k, v, layout, cu, backend="reference")
    out = block_sparse_attention(q, k, v, layout, cu, backend="torch")
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lengths,hq,hkv,dim,bs", CASES)
def test_gamma_one_equals_dense_per_document_causal(lengths, hq, hkv, dim, bs):
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(sum(lengths), hq, hkv, dim)
    layout = select_blocks(q, k, cu, Budget(gamma=1.0), block_size=bs)
    dense = per_document_causal(q, k, v, lengths)
    dense_grads = grads(dense, (q, k, v))
    for backend in ("reference", "torch"):
        out = block_sparse_attention(q, k, v, layout, cu, backend=backend)
        torch.testing.assert_close(out, dense, rtol=1e-10, atol=1e-10)
        for a, b in zip(grads(out, (q, k, v)), dense_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_including_empty_rows(seed, poisoned):
    """Hand-made layouts (non-causal pairs, missing diagonals, empty rows) follow to_mask."""
    lengths = (45, 3, 80)
    total, bs = sum(lengths), 16
    nb = -(-total // bs)
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(total, 4, 2, 32, seed=seed)
    bm = torch.rand(4, nb, nb, generator=torch.Generator().manual_seed(seed)) < 0.4
    layout = BlockLayout.from_block_mask(bm, cu, bs, 4)
    ref = block_sparse_attention(q, k, v, layout, cu, backend="reference")
    out = block_sparse_attention(q, k, v, layout, cu, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    no_key = ~layout.to_mask(cu).any(-1)  # (Hq, T)
    assert bool(no_key.any()), "the random layout should leave some queries without keys"
    assert bool((out.transpose(0, 1)[no_key] == 0).all())
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_error_is_within_twice_pytorch(dtype):
    """flash-attn style: error vs an fp64 truth at most ~2x what the reference makes in `dtype`."""
    lengths = (500, 524)
    cu = cu_from_lengths(lengths)
    q64, k64, v64 = make_qkv(sum(lengths), 4, 2, 64)
    layout = select_blocks(q64, k64, cu, Budget(gamma=0.8), block_size=64)
    truth = block_sparse_attention(q64, k64, v64, layout, cu, backend="reference")
    g_truth = grads(truth, (q64, k64, v64))
    low = [x.detach().to(dtype).requires_grad_() for x in (q64, k64, v64)]
    ref = block_sparse_attention(*low, layout, cu, backend="reference")
    out = block_sparse_attention(*low, layout, cu, backend="torch")
    assert out.dtype == dtype
    assert (out.double() - truth).abs().max() <= 2 * (ref.double() - truth).abs().max() + 1e-6
    for a, b, t in zip(grads(out, low), grads(ref, low), g_truth, strict=True):
        assert (a.double() - t).abs().max() <= 2 * (b.double() - t).abs().max() + 1e-5


def test_cost_follows_the_layout():
    """The torch backend computes only kept pairs: a sparse layout touches fewer key blocks."""
    cu = cu_from_lengths([2048])
    q, k, _ = make_qkv(2048, 2, 2, 32, dtype=torch.float32)
    dense = select_blocks(q, k, cu, Budget(gamma=1.0), block_size=64)
    sparse = BlockLayout.from_block_mask(torch.eye(32, dtype=torch.bool).expand(2, 32, 32).clone(), cu, 64, 2)
    blocks = torch.arange(32)
    for layout, want in ((dense, 2 * 32 * 33 // 2), (sparse, 64)):
        pairs = BlockPairs(layout, blocks, blocks, 2, q.device)
        slots = sum(int((c.kv_row >= 0).sum() - (~c.valid).sum()) for c in pairs.chunks)
        assert pairs.num_pairs == slots == layout.num_kept_pairs() == want
