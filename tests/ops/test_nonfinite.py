"""Non-finite inputs never cross documents in the ``torch`` and ``reference`` backends (issue 13,
item 8) and are not hidden by selection.

Masked positions (other documents, causally later keys, pairs outside the layout) contribute exact
zeros to outputs and to every gradient, even when they hold NaN or inf. The flex backend does no
such containment (issue 36: it costs more than the kernel); training skips a step whose loss or
gradients are non-finite instead (``tests/train/test_nonfinite_steps.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsebalance.ops import Budget, block_sparse_attention, select_blocks
from tests.conftest import cu_from_lengths, make_qkv

LENGTHS = (40, 88)  # the pack: cu_seqlens = [0, 40, 128]
BLOCK = 64


def _run(backend, q, k, v, layout, cu, grad):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = block_sparse_attention(q, k, v, layout, cu, backend=backend)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("where", ["q", "k", "v", "grad"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_stays_in_its_document(backend, where, bad):
    """The issue's case: a NaN (or inf) at token 10 of document 1; document 2 is untouched."""
    cu = cu_from_lengths(LENGTHS)
    q, k, v = make_qkv(128, 4, 2, 16, requires_grad=False)
    grad = torch.randn(128, 4, 16, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
    layout = select_blocks(q, k, cu, Budget(gamma=1.0), block_size=BLOCK)
    clean = _run(backend, q, k, v, layout, cu, grad)
    poisoned = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "grad": grad.clone()}
    # an output gradient in document 2 must not reach document 1; inputs in 1 must not reach 2
    poisoned[where][100 if where == "grad" else 10, 0, 0] = bad
    p, kk, vv, g = (poisoned[n] for n in ("q", "k", "v", "grad"))
    got = _run(backend, p, kk, vv, layout, cu, g)
    doc = slice(0, 40) if where == "grad" else slice(40, 128)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, clean, strict=True):
        assert bool(torch.isfinite(a[doc]).all()), f"{name}: non-finite crossed documents"
        torch.testing.assert_close(a[doc], b[doc], rtol=1e-12, atol=1e-12)
    if where in ("q", "k", "v"):
        # not hidden: the poisoned document's later queries see it (as with dense attention)
        assert not bool(torch.isfinite(got[0][10:40]).all())
        # and causally earlier queries of the same document do not
        torch.testing.assert_close(got[0][:10], clean[0][:10], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_torch_and_reference_agree_on_nan_values(gamma):
    """Same outputs, NaN pattern included, with NaN values in several documents."""
    lengths = (45, 3, 80, 30)
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(sum(lengths), 4, 2, 16, requires_grad=False, seed=4)
    layout = select_blocks(q, k, cu, Budget(gamma=gamma), block_size=16)
    v[[5, 46, 100], :, 3] = math.nan
    ref = block_sparse_attention(q, k, v, layout, cu, backend="reference")
    out = block_sparse_attention(q, k, v, layout, cu, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10, equal_nan=True)
    assert bool(ref.isnan().any()) and bool(torch.isfinite(ref[128:]).all())


def test_nan_key_is_not_hidden_by_selection():
    """NaN in k at gamma < 1: every later query block of the document keeps the bad block, so
    the NaN propagates as with dense attention; earlier blocks and other documents are clean."""
    cu = cu_from_lengths([512, 128])
    q, k, v = make_qkv(640, 2, 2, 16, requires_grad=False, seed=1)
    q = q * 3
    k[200, 1, 0] = math.nan  # block 3 (block 16) of document 1, KV head 1
    layout = select_blocks(q, k, cu, Budget(gamma=0.3), block_size=64)
    bm = layout.to_block_mask()
    assert bool(bm[1, 3:8, 3].all()), "later query blocks must keep the non-finite key block"
    assert layout.density() < 1.0
    out = block_sparse_attention(q, k, v, layout, cu, backend="torch")
    assert bool(out[200:512, 1].isnan().all()) and bool(torch.isfinite(out[512:]).all())
    assert bool(torch.isfinite(out[:192]).all())
