"""select_blocks: the threshold rule, anchors, floor/cap, dense budget, recall, determinism."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.ops import Budget, attention_recall, causal_block_mask, select_blocks
from tests.conftest import cu_from_lengths, make_qkv


def peaked_qk(total, hq, hkv, dim, hot_block, block_size, seed=0):
    """Queries that attend strongly to one key block (plus noise): selection must find it."""
    q, k, _ = make_qkv(total, hq, hkv, dim, dtype=torch.float32, seed=seed, requires_grad=False)
    direction = torch.zeros(dim)
    direction[0] = 1.0
    q = q * 0.1 + 4.0 * direction
    k = k * 0.1
    k[hot_block * block_size : (hot_block + 1) * block_size] += 4.0 * direction
    return q, k


@pytest.mark.parametrize("lengths", [(1025,), (97, 200, 1), (128, 128)], ids=str)
@pytest.mark.parametrize("share", [False, True])
def test_gamma_one_keeps_every_causal_block(lengths, share):
    cu = cu_from_lengths(lengths)
    q, k, _ = make_qkv(sum(lengths), 4, 2, 32, requires_grad=False)
    layout = select_blocks(q, k, cu, Budget(gamma=1.0), block_size=64, share_kv_groups=share)
    causal = causal_block_mask(cu, sum(lengths), 64)
    assert torch.equal(layout.to_block_mask(), causal[None].expand(layout.num_heads, -1, -1))
    assert layout.density() == 1.0
    assert layout.num_heads == (2 if share else 4)


def test_selection_finds_the_hot_block_and_anchors():
    bs, total = 16, 256
    q, k = peaked_qk(total, 2, 2, 32, hot_block=5, block_size=bs)
    cu = cu_from_lengths([total])
    layout = select_blocks(
        q, k, cu, Budget(gamma=0.5, sink_blocks=1, local_blocks=1), block_size=bs
    )
    bm = layout.to_block_mask()
    for qb in range(6, total // bs):
        kept = set(torch.nonzero(bm[0, qb]).flatten().tolist())
        assert kept == {0, 5, qb}, (qb, kept)  # sink, hot block, diagonal
    assert layout.density() < 0.35


def test_larger_gamma_keeps_superset_and_more_recall():
    cu = cu_from_lengths([300, 500])
    q, k, _ = make_qkv(800, 4, 4, 32, requires_grad=False, seed=1)
    q = q * 3  # sharper attention so the budget matters
    prev_mask, prev_recall = None, -1.0
    for gamma in (0.3, 0.6, 0.9, 1.0):
        layout = select_blocks(q, k, cu, Budget(gamma=gamma), block_size=32)
        mask = layout.to_block_mask()
        recall = float(attention_recall(q, k, layout, cu).mean())
        if prev_mask is not None:
            assert bool((mask | ~prev_mask).all()), "a larger gamma must keep a superset"
            assert recall >= prev_recall - 1e-12
        prev_mask, prev_recall = mask, recall
    assert prev_recall == pytest.approx(1.0)


def test_recall_tracks_gamma_on_block_structured_attention():
    # When keys within a block are identical, pooled estimates are exact: recall >= gamma.
    bs, total = 16, 512
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, 2, 16, generator=g, dtype=torch.float64)
    kb = torch.randn(total // bs, 2, 16, generator=g, dtype=torch.float64) * 2
    k = kb.repeat_interleave(bs, 0)
    q = (
        q.view(total // bs, bs, 2, 16)
        .mean(1, keepdim=True)
        .expand(-1, bs, -1, -1)
        .reshape(total, 2, 16)
    )
    cu = cu_from_lengths([total])
    for gamma in (0.5, 0.8, 0.95):
        budget = Budget(gamma=gamma, sink_blocks=0, local_blocks=0, min_blocks=0)
        layout = select_blocks(q, k, cu, budget, block_size=bs)
        assert layout.density() < 1.0
        # Per query block, off-diagonal mass is exact; the diagonal block's pooling is approximate.
        assert float(attention_recall(q, k, layout, cu).min()) >= gamma - 0.08


def test_min_blocks_and_max_density():
    cu = cu_from_lengths([1024])
    q, k = peaked_qk(1024, 2, 2, 32, hot_block=3, block_size=32)
    low = select_blocks(
        q, k, cu, Budget(gamma=0.05, min_blocks=6, sink_blocks=0, local_blocks=0), block_size=32
    )
    counts = low.kv_num_blocks[0]
    qb = torch.arange(32)
    assert bool((counts >= torch.clamp(qb + 1, max=6)).all())
    capped = select_blocks(
        q, k, cu, Budget(gamma=1.0, max_density=0.25, sink_blocks=0, local_blocks=0), block_size=32
    )
    assert bool((capped.kv_num_blocks[0] <= torch.ceil((qb + 1) * 0.25)).all())
    assert capped.density() < 0.4


def test_blocks_straddling_documents_keep_both_documents_anchors():
    # Block 1 holds the end of doc 0 and the start of doc 1: its keys must cover both documents.
    cu = cu_from_lengths([20, 44])
    q, k, _ = make_qkv(64, 2, 2, 16, requires_grad=False)
    layout = select_blocks(q, k, cu, Budget(gamma=0.01), block_size=16)
    bm = layout.to_block_mask()
    assert bool(bm[:, 1, 0].all()) and bool(bm[:, 1, 1].all())
    mask = layout.to_mask(cu)
    assert bool(mask[:, torch.arange(64), torch.arange(64)].all()), "every token sees itself"


def test_selection_is_deterministic_and_dtype_agnostic():
    cu = cu_from_lengths([100, 400])
    q, k, _ = make_qkv(500, 4, 2, 32, requires_grad=False)
    a = select_blocks(q, k, cu, Budget(gamma=0.7), block_size=32)
    b = select_blocks(q.clone(), k.clone(), cu, Budget(gamma=0.7), block_size=32)
    assert torch.equal(a.kv_indices, b.kv_indices) and torch.equal(a.kv_num_blocks, b.kv_num_blocks)
    c = select_blocks(q.float(), k.float(), cu, Budget(gamma=1.0), block_size=32)
    assert c.density() == 1.0


def test_estimate_once_many_budgets_matches_select_blocks():
    from sparsebalance.ops import estimate_block_mass

    cu = cu_from_lengths([300, 700])
    q, k, _ = make_qkv(1000, 4, 2, 32, requires_grad=False, seed=2)
    q = q * 3
    est = estimate_block_mass(q, k, cu, block_size=32)
    densities = []
    for gamma in (0.2, 0.5, 0.8, 1.0):
        budget = Budget(gamma=gamma)
        direct = select_blocks(q, k, cu, budget, block_size=32)
        via = est.layout(budget)
        assert torch.equal(direct.kv_indices, via.kv_indices)
        assert est.density(budget) == pytest.approx(direct.density(), abs=1e-12)
        torch.testing.assert_close(est.document_density(budget), direct.document_density())
        densities.append(est.density(budget))
    assert densities == sorted(densities) and densities[0] < densities[-1] == 1.0
