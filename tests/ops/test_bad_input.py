"""Bad input gives a clear ValueError/TypeError naming the argument; never a silent fallback."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.ops import Budget, block_sparse_attention, select_blocks
from tests.conftest import cu_from_lengths, make_qkv


@pytest.fixture
def inputs():
    q, k, v = make_qkv(100, 4, 2, 32, dtype=torch.float32, requires_grad=False)
    cu = cu_from_lengths([40, 60])
    return q, k, v, cu, select_blocks(q, k, cu, Budget(gamma=0.9), block_size=16)


@pytest.mark.parametrize("gamma", [0.0, -0.1, 1.5, float("nan")])
def test_gamma_out_of_range(gamma):
    with pytest.raises(ValueError, match="gamma"):
        Budget(gamma=gamma)


def test_budget_fields_validated():
    with pytest.raises(ValueError, match="sink_blocks"):
        Budget(gamma=0.9, sink_blocks=-1)
    with pytest.raises(ValueError, match="max_density"):
        Budget(top_k=4, max_density=0.0)
    with pytest.raises(TypeError, match="gamma"):
        Budget(gamma="0.5")


@pytest.mark.parametrize(
    "cu,match",
    [
        ([1, 40, 100], "start at 0"),
        ([0, 60, 40, 100], "increasing"),
        ([0, 40, 40, 100], "increasing"),
        ([0, 40, 90], "end at T"),
    ],
)
def test_bad_cu_seqlens(inputs, cu, match):
    q, k, v, _, layout = inputs
    bad = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        select_blocks(q, k, bad, Budget(gamma=0.9), block_size=16)
    with pytest.raises(ValueError, match=match):
        block_sparse_attention(q, k, v, layout, bad)


def test_cu_seqlens_dtype(inputs):
    q, k, v, cu, layout = inputs
    with pytest.raises(TypeError, match="cu_seqlens"):
        block_sparse_attention(q, k, v, layout, cu.float())


def test_shape_dtype_device_mismatch(inputs):
    q, k, v, cu, layout = inputs
    with pytest.raises(ValueError, match="Hq % Hkv"):
        block_sparse_attention(q[:, :3], k, v, layout, cu)
    with pytest.raises(ValueError, match="head dim"):
        block_sparse_attention(q, k[..., :16], v[..., :16], layout, cu)
    with pytest.raises(TypeError, match="dtype"):
        block_sparse_attention(q, k.double(), v.double(), layout, cu)
    with pytest.raises(ValueError, match="v shape"):
        block_sparse_attention(q, k, v[:, :1], layout, cu)
    with pytest.raises(ValueError, match="3-D"):
        block_sparse_attention(q[None], k, v, layout, cu)
    with pytest.raises(ValueError, match="tokens"):
        block_sparse_attention(q, k[:50], v[:50], layout, cu)


def test_layout_for_other_shapes(inputs):
    q, k, v, cu, layout = inputs
    other_cu = cu_from_lengths([50, 50])
    with pytest.raises(ValueError, match="another cu_seqlens"):
        block_sparse_attention(q, k, v, layout, other_cu)
    q2, k2, v2 = make_qkv(120, 4, 2, 32, dtype=torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="T=100"):
        block_sparse_attention(q2, k2, v2, layout, cu_from_lengths([120]))
    with pytest.raises(ValueError, match="Hq=4"):
        block_sparse_attention(q[:, :2], k, v, layout, cu)
    with pytest.raises(TypeError, match="layout"):
        block_sparse_attention(q, k, v, layout.to_block_mask(), cu)


def test_unknown_or_unavailable_backend(inputs):
    q, k, v, cu, layout = inputs
    with pytest.raises(ValueError, match="backend must be one of"):
        block_sparse_attention(q, k, v, layout, cu, backend="cuda")
    if not torch.cuda.is_available():  # flex trains only on CUDA (the CPU: forward only)
        qg = q.detach().requires_grad_()
        with pytest.raises(ValueError, match="flex"):
            block_sparse_attention(qg, k, v, layout, cu, backend="flex")
    with pytest.raises(ValueError, match="triton"):
        block_sparse_attention(q, k, v, layout, cu, backend="triton")


def test_bad_block_size_and_budget_type(inputs):
    q, k, _, cu, _ = inputs
    with pytest.raises(ValueError, match="block_size"):
        select_blocks(q, k, cu, Budget(gamma=0.9), block_size=0)
    with pytest.raises(TypeError, match="budget"):
        select_blocks(q, k, cu, 0.9, block_size=16)


def test_zero_head_dim_and_bad_scale(inputs):
    """head_dim = 0 gave ZeroDivisionError; scale = nan/inf was not checked."""
    q, k, v, cu, layout = inputs
    with pytest.raises(ValueError, match="head dim"):
        block_sparse_attention(q[..., :0], k[..., :0], v[..., :0], layout, cu)
    with pytest.raises(ValueError, match="head dim"):
        select_blocks(q[..., :0], k[..., :0], cu, Budget(gamma=0.9), block_size=16)
    for scale in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="scale"):
            block_sparse_attention(q, k, v, layout, cu, scale=scale)
        with pytest.raises(ValueError, match="scale"):
            select_blocks(q, k, cu, Budget(gamma=0.9), block_size=16, scale=scale)
    with pytest.raises(TypeError, match="scale"):
        block_sparse_attention(q, k, v, layout, cu, scale="big")


@pytest.mark.parametrize("densities", ["2,-1", "0.5,nan", "0"])
def test_bench_attn_quick_validates_densities(densities):
    """--quick used to overwrite --densities silently (so 2,-1 was never checked)."""
    from sparsebalance.commands import bench_attn

    parser = __import__("argparse").ArgumentParser()
    bench_attn.add_arguments(parser)
    args = parser.parse_args(["--quick", "--densities", densities, "--device", "cpu"])
    with pytest.raises(ValueError, match="--densities"):
        bench_attn.main(args)


def test_bench_attn_quick_keeps_explicit_densities():
    from sparsebalance.commands import bench_attn

    parser = __import__("argparse").ArgumentParser()
    bench_attn.add_arguments(parser)
    argv = ["--quick", "--densities", "0.5", "--seq-lens", "128", "--device", "cpu", "--json", "--packs", "none"]
    args = bench_attn.prepare_args(parser.parse_args([*argv, "--warmup", "0", "--repeats", "1"]))
    args.backends = ["torch"]
    result = bench_attn.run_benchmark(args)
    assert [r["target_density"] for r in result["rows"]] == [0.5]
