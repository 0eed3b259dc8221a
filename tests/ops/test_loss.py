"""The chunked lm-head + cross-entropy equals the plain loss, value and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from sparsebalance.data import pack
from sparsebalance.engine.loss import packed_loss
from sparsebalance.models.attention import PackedAttention
from sparsebalance.models.hf import build_model
from sparsebalance.ops import Budget
from sparsebalance.ops.loss import ChunkedLinearCrossEntropy, default_chunk_tokens, linear_cross_entropy, resolve_loss


def _inputs(t=203, h=24, v=97, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::7] = -100  # ignore_index: document ends, padding
    weights = torch.rand(t, generator=g, dtype=torch.float64) + 0.5  # per-doc style weights
    return hidden, weight, b, labels, weights


@pytest.mark.parametrize("chunk", [1, 16, 50, 203, 1000], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_chunked_equals_plain_float64(chunk, bias):
    hidden, weight, b, labels, weights = _inputs(bias=bias)
    params = [x for x in (hidden, weight, b) if x is not None]
    ref = linear_cross_entropy(hidden, weight, labels, weights, b, impl="plain")
    ref_grads = torch.autograd.grad(ref * 0.37, params)
    out = linear_cross_entropy(hidden, weight, labels, weights, b, impl="chunked", chunk_tokens=chunk)
    grads = torch.autograd.grad(out * 0.37, params)  # a non-unit upstream gradient
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_gradcheck_chunked():
    hidden, weight, b, labels, weights = _inputs(t=13, h=5, v=11)
    fn = lambda h, w, bb: ChunkedLinearCrossEntropy.apply(h, w, bb, labels, weights, 4, -100)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


def test_ignored_tokens_and_weights_count():
    hidden, weight, b, labels, weights = _inputs()
    labels[:] = -100
    assert float(linear_cross_entropy(hidden, weight, labels, weights, b, "chunked").detach()) == 0
    hidden, weight, b, labels, _ = _inputs()
    ones = linear_cross_entropy(hidden, weight, labels, None, b, impl="chunked")
    twos = linear_cross_entropy(hidden, weight, labels, torch.full((203,), 2.0), b, impl="chunked")
    torch.testing.assert_close(twos, 2 * ones)


def test_model_loss_and_grads_match_full_logits():
    """Through the real model (per-document weights, ignored document ends): the chunked loss on
    forward_hidden == logits + cross_entropy, value and every parameter's gradient."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 4096, (n,), generator=g).numpy() for n in (97, 140)]
    batch = pack(docs, "cpu", per_doc_weighting=True)
    results = []
    first = build_model("tiny", "cpu", torch.float64, seed=1)
    for chunked in (False, True):
        model = copy.deepcopy(first)
        ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=0.7), 32, "torch")
        batch.loss_weights = batch.loss_weights.double()
        loss = packed_loss(model, batch, ctx, "chunked" if chunked else "plain", chunk_tokens=60)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-12, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-10, atol=1e-13, msg=name)


def test_bad_arguments():
    hidden, weight, _, labels, _ = _inputs()
    with pytest.raises(ValueError, match="--loss"):
        linear_cross_entropy(hidden, weight, labels, impl="fused")
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:5])
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="liger"):
        resolve_loss("liger", torch.device("cpu"), True)
    assert resolve_loss("auto", torch.device("cpu"), True) == "chunked"
    assert default_chunk_tokens(151_936) == 441


@pytest.mark.gpu
def test_liger_matches_chunked_on_cuda():
    pytest.importorskip("liger_kernel")
    dev = torch.device("cuda")
    hidden, weight, _, labels, _ = _inputs(t=1000, h=64, v=5000, bias=False)
    hidden = hidden.float().to(dev).requires_grad_()
    weight = weight.float().to(dev).requires_grad_()
    labels = labels.to(dev)
    assert resolve_loss("auto", dev, True) == "chunked"  # Liger reads back: only when asked for
    ref = linear_cross_entropy(hidden, weight, labels, impl="chunked")
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    out = linear_cross_entropy(hidden, weight, labels, impl="liger")
    grads = torch.autograd.grad(out, (hidden, weight))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
