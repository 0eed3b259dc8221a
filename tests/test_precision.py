"""Issue 26, item 2: the precision setting. fp32 master weights, autocast on the run's device,
the same code on CPU as on CUDA: the review's mixed-dtype failure (RoPE's float32 cos/sin turning
bf16 q/k into float32 next to a bf16 v) reproduces here with ``torch.autocast("cpu")``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.data import pack
from sparsebalance.engine.loss import packed_loss
from sparsebalance.models.attention import PackedAttention
from sparsebalance.models.hf import build_model
from sparsebalance.ops import Budget
from sparsebalance.ops.loss import linear_cross_entropy
from sparsebalance.precision import compute_dtype, default_precision, resolve_precision
from tests.conftest import rel_rms


def _batch():
    g = np.random.default_rng(0)
    return pack([g.integers(0, 4096, n) for n in (100, 37, 70)], "cpu")


def test_defaults_fp32_on_cpu_bf16_on_cuda():
    assert default_precision("cpu") == "fp32" and default_precision("cuda") == "bf16"
    assert resolve_precision("auto", "cpu").name == "fp32"
    assert not resolve_precision("fp32", "cpu").mixed
    assert resolve_precision("fp16", "cpu").grad_scaler() is not None
    assert resolve_precision("bf16", "cpu").grad_scaler() is None
    with pytest.raises(ValueError, match="--precision must be one of"):
        resolve_precision("tf32", "cpu")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_hf_forward_backward_under_cpu_autocast(precision, backend):
    """Layer 0 used to raise ``TypeError: v.dtype torch.bfloat16 differs from q.dtype
    torch.float32`` on every backend."""
    model = build_model("tiny", "cpu", torch.float32, seed=0)
    batch = _batch()
    ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=0.8), block_size=32, backend=backend)
    loss = packed_loss(model, batch, ctx, "chunked", precision=resolve_precision(precision, "cpu"))
    loss.backward()
    assert loss.dtype == torch.float32 and bool(torch.isfinite(loss))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    ref_model = build_model("tiny", "cpu", torch.float32, seed=0)
    ref_ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=0.8), block_size=32, backend=backend)
    ref = packed_loss(ref_model, batch, ref_ctx, "chunked", precision=resolve_precision("fp32", "cpu"))
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=2e-2)  # low precision, same function


def test_compute_dtype_is_autocasts_inside_it_and_the_lowest_outside():
    a, b = torch.zeros(2, dtype=torch.float32), torch.zeros(2, dtype=torch.bfloat16)
    assert compute_dtype(a, a, b) == torch.bfloat16
    assert compute_dtype(a, a, a) == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        assert compute_dtype(a, a, b) == torch.float16


def test_chunked_loss_under_autocast_is_consistent_forward_and_backward():
    """The chunked loss computes its logits in the autocast dtype in the forward *and* in the
    backward (which runs outside autocast): its gradient is the plain loss's under the same
    autocast up to bf16 rounding, not the gradient of float32 logits."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=g, requires_grad=True)
    weight = (torch.randn(50, 32, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, 50, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(hidden, weight, labels, impl="chunked", chunk_tokens=16)
        ref = linear_cross_entropy(hidden, weight, labels, impl="plain")
    got = torch.autograd.grad(out, (hidden, weight))
    want = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    for a, b in zip(got, want, strict=True):
        assert rel_rms(a, b) < 1e-2  # both round to bf16: about 2**-8 apart
