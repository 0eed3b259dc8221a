"""gpu tier (issue 26, items 2 and 8): bf16/fp16 autocast with float32 master weights on CUDA,
the flex backend inside a Hugging Face model (activation-checkpoint recompute included), and
Liger's fused loss under autocast with float32 weights (Liger-Kernel #501's addmm failure)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.data import pack
from sparsebalance.engine.loss import packed_loss
from sparsebalance.models.attention import PackedAttention
from sparsebalance.models.checkpointing import apply_activation_checkpointing
from sparsebalance.models.hf import build_model
from sparsebalance.ops import Budget
from sparsebalance.ops.loss import linear_cross_entropy
from sparsebalance.precision import resolve_precision
from tests.conftest import rel_rms

pytestmark = pytest.mark.gpu


def _step(precision: str, checkpointing: str = "off", backend: str = "flex"):
    model = build_model("tiny", "cuda", torch.float32, seed=0)
    apply_activation_checkpointing(model, checkpointing)
    g = np.random.default_rng(0)
    batch = pack([g.integers(0, 4096, n) for n in (700, 1500, 230)], "cuda")
    ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=0.8), block_size=128, backend=backend)
    loss = packed_loss(model, batch, ctx, "chunked", precision=resolve_precision(precision, "cuda"))
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return loss.detach(), grads, model


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_step_with_flex_keeps_float32_master_weights(precision):
    loss, grads, model = _step(precision)
    ref_loss, ref_grads, _ = _step("fp32")
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(grads).all())
    assert float(loss) == pytest.approx(float(ref_loss), rel=2e-2)
    assert rel_rms(grads, ref_grads) < 5e-2


def test_activation_checkpoint_recompute_under_bf16_equals_no_checkpointing():
    loss, grads, _ = _step("bf16", "full")
    ref_loss, ref_grads, _ = _step("bf16", "off")
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-3)
    assert rel_rms(grads, ref_grads) < 1e-2


def test_liger_under_bf16_autocast_with_float32_weights():
    pytest.importorskip("liger_kernel")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2000, 128, generator=g).cuda().requires_grad_()
    weight = (torch.randn(8000, 128, generator=g) * 0.2).cuda().requires_grad_()
    labels = torch.randint(0, 8000, (2000,), generator=g).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = linear_cross_entropy(hidden, weight, labels, impl="liger")
        ref = linear_cross_entropy(hidden, weight, labels, impl="chunked")
    got = torch.autograd.grad(out, (hidden, weight))
    want = torch.autograd.grad(ref, (hidden, weight))
    assert weight.dtype == torch.float32
    assert float(out) == pytest.approx(float(ref), rel=1e-2)
    assert all(rel_rms(a.float(), b.float()) < 3e-2 for a, b in zip(got, want, strict=True))
