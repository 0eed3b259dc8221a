"""Ring attention on P = 2 and 4 gloo processes equals the single-process op: outputs and q/k/v
gradients, every placement, dense (gamma = 1) and sparse layouts, several documents per pack,
lengths not divisible by P or the block size; the distributed selection equals select_blocks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sparsebalance.ops import Budget, block_sparse_attention, random_layout, select_blocks
from sparsebalance.parallel import (
    PLACEMENTS,
    build_mesh,
    hierarchical_ring_attention,
    make_placement,
    mesh_ranks,
    ring_attention,
    select_blocks_distributed,
)

from ..conftest import cu_from_lengths, make_qkv, rel_rms
from .spawn import run_workers

BLOCK = 16
# T = 203: not a multiple of the block size, of P, or of 2P blocks; a 1-token document.
LENGTHS = (50, 1, 79, 73)


def _layouts(q, k, cu, gamma, share_kv_groups=False):
    if gamma == "random":
        return random_layout(cu, q.shape[1], BLOCK, 0.35, seed=3)
    return select_blocks(q, k, cu, Budget(gamma=gamma), BLOCK, share_kv_groups=share_kv_groups)


def check_case(rank, world, kind, dtype, gamma, inner_size=None, share_kv_groups=False, hq=4, default_inner=False):
    """One configuration on this rank: layout, output and all three gradients."""
    cu = cu_from_lengths(LENGTHS)
    q, k, v = make_qkv(int(cu[-1]), hq, 2, 8, dtype=dtype, seed=1)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grad = grad.to(dtype)
    layout = _layouts(q.detach(), k.detach(), cu, gamma, share_kv_groups)
    ref = block_sparse_attention(q, k, v, layout, cu, backend="torch")
    ref.backward(grad)

    placement = make_placement(kind, int(cu[-1]), BLOCK, world)
    ql, kl, vl = (placement.shard(x.detach(), rank).requires_grad_() for x in (q, k, v))
    if gamma != "random":
        mine = select_blocks_distributed(
            None, ql, kl, placement, cu, Budget(gamma=gamma), share_kv_groups=share_kv_groups
        )
        assert torch.equal(mine.to_block_mask(), layout.to_block_mask()), (kind, gamma)
        layout = mine
    if default_inner:  # hierarchical, inner size from the launcher's topology
        out = hierarchical_ring_attention(None, ql, kl, vl, layout, placement)
    elif inner_size is None:
        out = ring_attention(None, ql, kl, vl, layout, placement)
    else:
        out = hierarchical_ring_attention(None, ql, kl, vl, layout, placement, inner_size)
    out.backward(placement.shard(grad, rank))

    pad = placement.token_index(rank) >= placement.seq_len
    assert bool((out[pad] == 0).all()) and not bool(out.isnan().any())
    pairs = [(out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)]
    for name, (got, want) in zip(("out", "dq", "dk", "dv"), pairs, strict=True):
        want = placement.shard(want.detach(), rank)
        tag = f"{name} {kind} {dtype} gamma={gamma} inner={inner_size} rank={rank}"
        if dtype == torch.float64:
            err = float((got.detach() - want).abs().max())
            assert err <= 1e-10, f"{tag}: max abs error {err:.2e}"
        else:
            err = rel_rms(got.detach(), want)
            assert err <= 2e-6, f"{tag}: relative RMS error {err:.2e}"


def _nan_checks(rank, world):
    """Issue 13 item 8 in the ring: a NaN in document 2 (tokens 51..129) of q, k or v, or in the
    output gradient, leaves every other document's outputs and gradients exactly clean."""
    cu = cu_from_lengths(LENGTHS)
    q, k, v = make_qkv(int(cu[-1]), 4, 2, 8, requires_grad=False, seed=5)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(6), dtype=q.dtype)
    layout = select_blocks(q, k, cu, Budget(gamma=1.0), BLOCK)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    want = block_sparse_attention(*ref, layout, cu, backend="torch")
    want.backward(grad)
    want = [want.detach()] + [x.grad for x in ref]
    outside = torch.ones(int(cu[-1]), dtype=torch.bool)
    outside[51:130] = False
    for kind in ("striped", "zigzag"):
        placement = make_placement(kind, int(cu[-1]), BLOCK, world)
        for where in ("q", "k", "v", "grad"):
            inputs = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "grad": grad.clone()}
            inputs[where][60, 0, 0] = float("nan")
            ql, kl, vl = (placement.shard(inputs[n], rank).requires_grad_() for n in "qkv")
            out = ring_attention(None, ql, kl, vl, layout, placement)
            out.backward(placement.shard(inputs["grad"], rank))
            mine = outside[placement.token_index(rank).clamp(max=int(cu[-1]) - 1)]
            mine &= placement.token_index(rank) < int(cu[-1])
            for name, got, ref_t in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), want, strict=True):
                got, exp = got.detach()[mine], placement.shard(ref_t, rank)[mine]
                assert bool(torch.isfinite(got).all()), f"{name} {kind} {where}: NaN crossed"
                assert float((got - exp).abs().max()) <= 1e-10, f"{name} {kind} {where}"


def _flat_worker(rank, world):
    _nan_checks(rank, world)
    for kind in PLACEMENTS:
        for gamma in (1.0, 0.8, "random"):
            check_case(rank, world, kind, torch.float64, gamma)
        check_case(rank, world, kind, torch.float32, 0.8)
    # one KV-group-shared layout (layout heads = Hkv) and plain multi-head attention
    check_case(rank, world, "striped", torch.float64, 0.8, share_kv_groups=True)
    check_case(rank, world, "zigzag", torch.float64, 0.8, hq=2)


def _hierarchical_checks(rank, world):
    import os

    from sparsebalance.parallel.hierarchical import default_inner_size

    assert default_inner_size(None) == world  # no launcher variables: one node, a flat ring
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 "nodes" of 2: the default inner ring is a node
    assert default_inner_size(None) == 2
    check_case(rank, world, "striped", torch.float64, 0.8, inner_size=None, default_inner=True)
    del os.environ["LOCAL_WORLD_SIZE"]
    for kind in PLACEMENTS:
        check_case(rank, world, kind, torch.float64, 1.0, inner_size=2)
        check_case(rank, world, kind, torch.float64, 0.8, inner_size=2)
    check_case(rank, world, "striped", torch.float32, 0.8, inner_size=2)
    check_case(rank, world, "zigzag", torch.float64, "random", inner_size=2)


def _mesh_checks(rank, world):
    """dp=2 x cp=2 mesh: each group rings its own pack on its cp subgroup (peers are global
    ranks 0-1 and 2-3), and the dp groups link the groups' ranks."""
    ranks = mesh_ranks(build_mesh(2, 2))
    assert (ranks.dp_rank, ranks.cp_rank) == divmod(rank, 2)
    cu = cu_from_lengths((37, 60) if ranks.dp_rank == 0 else (120, 3, 9))
    q, k, v = make_qkv(int(cu[-1]), 4, 2, 8, seed=10 + ranks.dp_rank)
    layout = select_blocks(q.detach(), k.detach(), cu, Budget(gamma=0.7), BLOCK)
    ref = block_sparse_attention(q, k, v, layout, cu, backend="torch")
    ref.sum().backward()
    placement = make_placement("striped", int(cu[-1]), BLOCK, 2)
    ql, kl, vl = (placement.shard(x.detach(), ranks.cp_rank).requires_grad_() for x in (q, k, v))
    mine = select_blocks_distributed(ranks.cp_group, ql, kl, placement, cu, Budget(gamma=0.7))
    assert torch.equal(mine.to_block_mask(), layout.to_block_mask())
    out = ring_attention(ranks.cp_group, ql, kl, vl, mine, placement)
    out.sum().backward()
    for got, want in ((out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)):
        err = float((got.detach() - placement.shard(want.detach(), ranks.cp_rank)).abs().max())
        assert err <= 1e-10, f"mesh rank {rank}: error {err:.2e}"
    total = torch.tensor([float(ranks.dp_rank)])
    dist.all_reduce(total, group=ranks.dp_group)
    assert float(total) == 1.0  # one rank of each group


def _four_rank_worker(rank, world):
    _flat_worker(rank, world)
    _hierarchical_checks(rank, world)
    _mesh_checks(rank, world)


@pytest.mark.distributed
def test_two_ranks_match_single_process(tmp_path):
    run_workers(_flat_worker, 2, tmp_path)


@pytest.mark.distributed
def test_four_ranks_flat_hierarchical_2x2_and_mesh_match_single_process(tmp_path):
    """One spawn (process start-up dominates on 2 cores): the flat ring at P = 4 for every
    placement, the hierarchical ring with 2 groups of 2, and a dp=2 x cp=2 DeviceMesh."""
    run_workers(_four_rank_worker, 4, tmp_path)


def test_ring_wait_counts_the_time_blocked_on_transfers():
    import time

    from sparsebalance.parallel.p2p import _Pending, ring_wait_seconds

    class _SlowRequest:  # a peer whose shard arrives 50 ms late
        def wait(self):
            time.sleep(0.05)

    before = ring_wait_seconds()
    buf = torch.zeros(3)
    assert _Pending(buf, [_SlowRequest()]).wait() is buf
    assert ring_wait_seconds() - before >= 0.05
    mid = ring_wait_seconds()
    _Pending(buf, None).wait()  # a ring of one rank: nothing to wait for
    assert ring_wait_seconds() - mid < 0.01
