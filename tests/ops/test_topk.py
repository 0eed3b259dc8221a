"""Top-k block budgets (MoBA): selection against a brute-force reference, anchors on top of k,
full coverage = dense attention, the gate's coverage, the analytic density."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sparsebalance.ops import (
    Budget,
    block_sparse_attention,
    causal_block_mask,
    estimate_block_mass,
    select_blocks,
    topk_density,
    topk_for_density,
)
from tests.conftest import cu_from_lengths, make_qkv


def brute_force_topk(q, k, lengths, block, top_k, share=False):
    """Bool ``(H, nb, nb)``: per (head, query block), the sink and diagonal blocks plus the
    ``top_k`` other causal blocks of its document with the largest mean-query . mean-key score
    (ties: the earlier block), written from the definition with Python loops (block-aligned
    documents, so every non-anchor key block is a whole block of the query's document)."""
    hq, hkv = q.shape[1], k.shape[1]
    heads = hkv if share else hq
    nb = sum(lengths) // block
    out = torch.zeros(heads, nb, nb, dtype=torch.bool)
    qb = q.double().view(nb, block, hq, -1).mean(1)  # (nb, Hq, D)
    kb = k.double().view(nb, block, hkv, -1).mean(1)
    start = 0
    for n in lengths:
        first = start // block
        for i in range(first, first + n // block):
            for h in range(heads):
                # a shared layout head averages its group's estimated probabilities
                group = range(h * hq // hkv, (h + 1) * hq // hkv) if share else [h]
                anchors = {first, i}
                cands = [j for j in range(first, i + 1) if j not in anchors]
                # rank by the mean over the group of the softmax over the causal blocks
                score = {}
                for j in cands:
                    vals = []
                    for g in group:
                        logits = torch.stack([qb[i, g] @ kb[jj, g // (hq // hkv)] for jj in range(first, i + 1)])
                        logits = logits / q.shape[-1] ** 0.5
                        bias = torch.full_like(logits, np.log(block))
                        bias[-1] = np.log((block + 1) / 2)  # the diagonal counts half
                        vals.append(torch.softmax(logits + bias, 0)[j - first])
                    score[j] = float(torch.stack(vals).mean())
                best = sorted(cands, key=lambda j: (-score[j], j))[:top_k]
                for j in anchors | set(best):
                    out[h, i, j] = True
        start += n
    return out


@pytest.mark.parametrize("lengths", [(256,), (128, 64, 192)], ids=str)
@pytest.mark.parametrize("top_k", [0, 1, 3])
@pytest.mark.parametrize("share", [False, True])
def test_selection_matches_brute_force(lengths, top_k, share):
    block = 32
    q, k, _ = make_qkv(sum(lengths), 4, 2, 16, dtype=torch.float32, seed=3, requires_grad=False)
    q = q * 2.5  # a peaked gate: rank ties are unlikely
    cu = cu_from_lengths(lengths)
    layout = select_blocks(q, k, cu, Budget(top_k=top_k), block_size=block, share_kv_groups=share)
    expected = brute_force_topk(q, k, lengths, block, top_k, share)
    assert torch.equal(layout.to_block_mask(), expected)


@pytest.mark.parametrize("lengths", [(1025,), (97, 200, 1, 511)], ids=str)
def test_every_query_attends_to_at_most_k_plus_anchors_blocks(lengths):
    """Odd lengths (documents sharing blocks): each query token's computed key blocks, read off
    the token mask, number at most k + sink + local; larger k keeps a superset."""
    q, k, _ = make_qkv(sum(lengths), 2, 1, 16, dtype=torch.float32, requires_grad=False)
    cu = cu_from_lengths(lengths)
    est = estimate_block_mass(q, k, cu, block_size=32)
    prev = None
    for top_k in (0, 2, 5):
        budget = Budget(top_k=top_k, sink_blocks=1, local_blocks=1)
        mask = est.layout(budget).to_mask(cu)  # (H, T, T)
        onehot = torch.nn.functional.one_hot(torch.arange(sum(lengths)) // 32).float()  # (T, nb)
        blocks = (mask.float() @ onehot) > 0  # (H, T, nb): the key blocks each query computes
        assert int(blocks.sum(-1).max()) <= top_k + 2
        if prev is not None:
            assert bool((mask | ~prev).all()), "a larger k must keep a superset"
        prev = mask


@pytest.mark.parametrize("lengths", [(300,), (97, 200, 1)], ids=str)
def test_full_coverage_is_dense_attention(lengths):
    """Once k covers every causal block, top-k attention is exact attention (float64)."""
    q, k, v = make_qkv(sum(lengths), 4, 2, 16)
    cu = cu_from_lengths(lengths)
    layout = select_blocks(q, k, cu, Budget(top_k=64), block_size=16)
    causal = causal_block_mask(cu, sum(lengths), 16)
    assert torch.equal(layout.to_block_mask(), causal[None].expand(4, -1, -1))
    assert layout.density() == 1.0
    out = block_sparse_attention(q, k, v, layout, cu)
    ref = []  # dense causal attention per document, from PyTorch's own SDPA
    for s, e in itertools.pairwise(cu.tolist()):
        kk, vv = (x[s:e].repeat_interleave(2, dim=1).transpose(0, 1) for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q[s:e].transpose(0, 1), kk, vv, is_causal=True)
        ref.append(o.transpose(0, 1))
    torch.testing.assert_close(out, torch.cat(ref), rtol=1e-10, atol=1e-10)
    est = estimate_block_mass(q, k, cu, block_size=16)
    assert est.coverage(Budget(top_k=64)) == pytest.approx(1.0, abs=1e-12)


def test_coverage_is_monotone_and_bounds_the_gamma_rule():
    q, k, _ = make_qkv(1024, 4, 4, 32, dtype=torch.float32, seed=2, requires_grad=False)
    q = q * 3
    cu = cu_from_lengths([600, 424])
    est = estimate_block_mass(q, k, cu, block_size=32)
    covs = [est.coverage(Budget(top_k=kk)) for kk in range(0, 20)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(covs))
    assert covs[0] > 0 and covs[-1] == pytest.approx(1.0, abs=1e-6)
    for gamma in (0.3, 0.6, 0.9):  # the gamma rule keeps at least gamma of each row's mass
        assert est.coverage(Budget(gamma=gamma)) >= gamma - 1e-6
    per_doc = est.document_coverage(Budget(top_k=3))
    assert per_doc.shape == (2,) and bool(((per_doc > 0) & (per_doc <= 1 + 1e-9)).all())
    tokens = torch.tensor([600.0, 424.0], dtype=torch.float64)
    assert est.coverage(Budget(top_k=3)) == pytest.approx(float((per_doc * tokens).sum() / tokens.sum()))


@pytest.mark.parametrize("n_blocks", [1, 3, 10, 64])
@pytest.mark.parametrize("top_k", [0, 1, 4, 100])
def test_analytic_density_is_the_layouts(n_blocks, top_k):
    block = 16
    lengths = (n_blocks * block,)
    q, k, _ = make_qkv(sum(lengths), 2, 2, 8, dtype=torch.float32, requires_grad=False)
    layout = select_blocks(q, k, cu_from_lengths(lengths), Budget(top_k=top_k), block_size=block)
    assert layout.density() == pytest.approx(float(topk_density(lengths[0], top_k, block)))
    d = topk_density(lengths[0], top_k, block)
    if d < 1:
        assert float(topk_for_density(lengths[0], d, block)) == pytest.approx(top_k, abs=1e-9)


def test_budget_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of gamma"):
        Budget()
    with pytest.raises(ValueError, match="exactly one of gamma"):
        Budget(gamma=0.9, top_k=4)
    with pytest.raises(ValueError, match="top_k"):
        Budget(top_k=-1)
    with pytest.raises(ValueError, match="top_k"):
        Budget(top_k=2.5)
    b = Budget(top_k=np.int64(4))
    assert (b.kind, b.value, b.top_k, type(b.top_k)) == ("top-k", 4.0, 4, int)
    assert b.with_value(6.6).top_k == 7 and Budget(gamma=0.5).with_value(0.7).gamma == 0.7
    assert not Budget(top_k=10**6).is_dense  # dense only where it covers the document
