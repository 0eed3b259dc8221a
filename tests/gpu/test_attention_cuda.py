"""gpu tier (issue 26, items 1, 5, 6, 8): the attention op on CUDA. flex vs torch backend vs the
float64 reference, forward and every gradient, bf16 and fp32, Qwen2.5-0.5B's heads (14 query
heads over 2 KV heads, head dim 64), several packed lengths in one process (a bounded number of
compiled graphs), non-finite inputs, block 64 refused before compiling."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from sparsebalance.ops import Budget, block_sparse_attention, select_blocks
from tests.conftest import cu_from_lengths, make_qkv, rel_rms

pytestmark = pytest.mark.gpu
HQ, HKV, D = 14, 2, 64  # Qwen2.5-0.5B
PACKS = [(1000, 3000, 96), (517, 2048, 33, 1200), (4000,)]  # documents off block boundaries


def _case(lengths, dtype, block, gamma=0.6, seed=0):
    cu = cu_from_lengths(lengths, "cuda")
    q, k, v = make_qkv(sum(lengths), HQ, HKV, D, dtype=dtype, device="cuda", seed=seed)
    layout = select_blocks(q.detach(), k.detach(), cu, Budget(gamma=gamma), block_size=block)
    return q, k, v, cu, layout


def _fwd_bwd(backend, q, k, v, layout, cu, grad):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = block_sparse_attention(q, k, v, layout, cu, backend=backend)
    out.backward(grad.to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths", PACKS, ids=lambda p: f"N{len(p)}-T{sum(p)}")
def test_flex_and_torch_backends_match_the_float64_reference(dtype, lengths):
    """Each kernel's error against float64 at most twice what the reference itself makes in
    ``dtype`` (flash-attention's rule), and 1e-3 relative RMS at worst in fp32."""
    q, k, v, cu, layout = _case(lengths, dtype, 128)
    assert 0.05 < layout.density() < 1.0
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to("cuda")
    exact = _fwd_bwd("reference", q.double(), k.double(), v.double(), layout, cu, grad.double())
    low = _fwd_bwd("reference", q, k, v, layout, cu, grad)
    for backend in ("flex", "torch"):
        got = _fwd_bwd(backend, q, k, v, layout, cu, grad)
        for name, a, ref, own in zip(("out", "dq", "dk", "dv"), got, exact, low, strict=True):
            bound = max(2 * rel_rms(own, ref), 1e-3 if dtype == torch.float32 else 1e-2)
            assert rel_rms(a, ref) <= bound, (backend, name, rel_rms(a, ref), bound)


def test_block_64_is_refused_before_flex_compiles_and_runs_on_the_torch_backend():
    q, k, v, cu, layout = _case((700, 900), torch.bfloat16, 64)
    with pytest.raises(ValueError, match="--block-size 64 cannot compile with the flex backend"):
        block_sparse_attention(q, k, v, layout, cu, backend="flex")
    grad = torch.randn(q.shape, device="cuda")
    exact = _fwd_bwd("reference", q.double(), k.double(), v.double(), layout, cu, grad.double())
    got = _fwd_bwd("torch", q, k, v, layout, cu, grad)
    assert all(rel_rms(a, b) < 2e-2 for a, b in zip(got, exact, strict=True))


def test_ten_packed_lengths_train_in_at_most_two_graphs_per_dtype_and_grad_mode():
    """Including a 2-token filler, one-block packs, and block counts equal to the head count
    (14) and the head dim (64): sizes Dynamo would specialise on."""
    torch._dynamo.reset()
    counters.clear()
    for i, total in enumerate((2, 100, 1792, 8192, 3000, 517, 12345, 4096, 999, 20000)):
        lengths = (total,) if total < 3 else (total // 3, total - total // 3)
        q, k, v, cu, layout = _case(lengths, torch.bfloat16, 128, seed=i)
        out = block_sparse_attention(q, k, v, layout, cu, backend="flex")
        out.float().square().mean().backward()
        assert bool(torch.isfinite(q.grad).all())
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def _gqa_flex(gqa):
    from sparsebalance.ops import block_sparse_flex

    def run(q, k, v, layout, cu):
        return block_sparse_flex.flex_block_sparse_attention(q, k, v, layout, D**-0.5, gqa=gqa)

    return run


@pytest.mark.parametrize("gqa", ["expand", "native"])
@pytest.mark.parametrize(
    "lengths, top_k",
    [
        pytest.param((6000, 300, 700, 45, 3000), 8, id="sparse-dense-dense-dense-sparse"),
        pytest.param((900, 1500, 2000), 64, id="all-dense"),
        pytest.param((8192,), 4, id="one-sparse"),
    ],
)
def test_flex_with_dense_runs_matches_the_float64_reference(gqa, lengths, top_k):
    """Issue 36, items 3-4: K/V expanded or flex's own GQA, documents the budget covers through
    FlashAttention varlen, bf16, forward and every gradient within flash-attention's rule."""
    cu = cu_from_lengths(lengths, "cuda")
    q, k, v = make_qkv(sum(lengths), HQ, HKV, D, dtype=torch.bfloat16, device="cuda", seed=3)
    layout = select_blocks(q.detach(), k.detach(), cu, Budget(top_k=top_k), block_size=128)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to("cuda")
    exact = _fwd_bwd("reference", q.double(), k.double(), v.double(), layout, cu, grad.double())
    low = _fwd_bwd("reference", q, k, v, layout, cu, grad)
    run = _gqa_flex(gqa)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = run(qq, kk, vv, layout, cu)
    out.backward(grad.to(out.dtype))
    got = [out.detach(), qq.grad, kk.grad, vv.grad]
    for name, a, ref, own in zip(("out", "dq", "dk", "dv"), got, exact, low, strict=True):
        bound = max(2 * rel_rms(own, ref), 1e-2)
        assert rel_rms(a, ref) <= bound, (gqa, name, rel_rms(a, ref), bound)


def test_the_dense_path_uses_flash_varlen_on_cuda():
    from sparsebalance.ops.dense import uses_varlen, varlen_api

    q = torch.zeros(8, HQ, D, dtype=torch.bfloat16, device="cuda")
    assert varlen_api() is not None, "torch.nn.attention.varlen is missing on this image"
    assert uses_varlen(q, D**-0.5)


def test_varlen_takes_the_models_heads_first_views():
    """The model hands q/k/v over as (T, H, D) views of heads-first tensors (not contiguous)."""
    from sparsebalance.ops.dense import dense_attention

    lengths = (300, 1000, 77)
    cu = cu_from_lengths(lengths, "cuda")
    q, k, v = make_qkv(sum(lengths), HQ, HKV, D, dtype=torch.bfloat16, device="cuda", seed=7)
    views = [x.detach().transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v)]
    assert not views[0].is_contiguous()
    want = dense_attention(q.detach(), k.detach(), v.detach(), cu, lengths, D**-0.5)
    got = dense_attention(*views, cu, lengths, D**-0.5)
    torch.testing.assert_close(got, want)
