"""The one-batch top-k gate (issue 42, item 3): the same layouts and coverages as the per-document
estimate (the spec), a launch count that does not grow with the documents, the coverage bound
on the device equal to the host's, non-finite keys not hidden, and the fallback for packs of many
short scored documents."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparsebalance.launches import LaunchCounter
from sparsebalance.ops import Budget, estimate_block_mass, select_blocks
from sparsebalance.ops.pack_index import PackIndex
from sparsebalance.ops.topk_gate import GateTables, TopKGate
from tests.conftest import cu_from_lengths, make_qkv

PACKS = [
    pytest.param((1024,), 64, id="1doc-aligned"),
    pytest.param((1025,), 64, id="1doc-B64-T1025"),
    pytest.param((97, 200, 1, 511), 32, id="4docs-off-boundaries"),
    pytest.param((300, 40, 37, 500, 90), 32, id="5docs-short-and-long"),
    pytest.param((130, 270, 600, 777), 64, id="4docs-B64"),
]


def _gate(lengths, block, dtype=torch.float32, seed=0):
    q, k, _ = make_qkv(sum(lengths), 4, 2, 16, dtype=dtype, seed=seed, requires_grad=False)
    q = q * 3  # a peaked gate: no near-ties between the two implementations' roundings
    cu = cu_from_lengths(lengths)
    pack = PackIndex.build(cu, block, lengths)
    gate = TopKGate.score(q, k, GateTables.of(pack, Budget(top_k=0)), 16**-0.5)
    return gate, estimate_block_mass(q, k, cu, block, pack=pack), q, k, cu, pack


@pytest.mark.parametrize("lengths, block", PACKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_layouts_and_coverages_equal_the_per_document_estimate(lengths, block, dtype):
    gate, spec, *_ = _gate(lengths, block, dtype)
    for k in (0, 1, 3, 6):
        budget = Budget(top_k=k)
        ours, theirs = gate.layout(budget), spec.layout(budget)
        assert torch.equal(ours.block_mask, theirs.block_mask), k
        assert ours.dense_docs == theirs.dense_docs
        ks = list(range(k, k + 4))
        np.testing.assert_allclose(gate.coverage_curve(budget, ks), spec.coverage_curve(budget, ks), rtol=0, atol=1e-6)


def test_select_blocks_takes_it_for_top_k_and_keeps_the_per_document_path_otherwise(monkeypatch):
    q, k, _ = make_qkv(900, 4, 2, 16, requires_grad=False)
    cu = cu_from_lengths((600, 300))
    scored = []
    real = TopKGate.score.__func__
    monkeypatch.setattr(TopKGate, "score", classmethod(lambda cls, *a: scored.append(1) or real(cls, *a)))
    select_blocks(q, k, cu, Budget(top_k=2), block_size=32)
    assert scored == [1]
    select_blocks(q, k, cu, Budget(top_k=2, max_density=0.5), block_size=32)  # a cap
    select_blocks(q, k, cu, Budget(gamma=0.9), block_size=32)
    select_blocks(q, k, cu, Budget(top_k=2), block_size=32, share_kv_groups=True)
    assert scored == [1]


def _launches(lengths, block, floor=False):
    gate, _, q, k, *_ = _gate(lengths, block)
    tables = gate.tables
    budget = Budget(top_k=1)
    if floor:
        budget = Budget(top_k=1, floor=torch.tensor(2))
    gate.layout(budget)  # the pack's tables for this budget, once per micro-batch
    gate.coverage_floor(budget, (0, 1, 2), 0.1)
    with LaunchCounter() as count:
        layer = TopKGate.score(q, k, tables, 16**-0.5)
        if floor:
            layer.coverage_floor(budget, (0, 1, 2), 0.1)
        layer.layout(budget)
    assert not count.reads, count.reads
    return count.num_ops


@pytest.mark.parametrize("floor", [False, True], ids=["k", "k-and-device-floor"])
def test_a_layer_launches_as_much_for_64_documents_as_for_4(floor):
    """Every document selected (more than 3 blocks each), none on block boundaries."""
    few = _launches((2011, 1998, 2003, 2180), 32, floor)
    many = _launches((127,) * 63 + (8192 - 63 * 127,), 32, floor)
    assert few == many <= (25 if floor else 13), (few, many)


def test_the_bound_decided_on_the_device_is_the_hosts():
    gate, spec, *_ = _gate((2048, 1024), 64, seed=1)
    base = Budget(top_k=12)
    ks = tuple(range(3, 13))
    curve = gate.coverage_curve(base, ks)
    for p in (0.0, 0.01, 0.05, 0.2, 1.0):
        first = int(gate.coverage_floor(base, ks, p)[0])
        assert first == int(np.argmax(curve >= curve[-1] - p - 1e-7)), p
        assert first == int(spec.coverage_floor(base, ks, p)[0]), p


def test_a_non_finite_key_is_not_hidden():
    """NaN scores rank first: every later query block of the document keeps the bad key block
    (with k = 1), and the other document's layout is untouched."""
    lengths, block = (512, 256), 64
    q, k, _ = make_qkv(768, 4, 2, 16, requires_grad=False)
    k[200, 1, 0] = math.nan  # block 3 of document 0, KV head 1 (query heads 2 and 3)
    pack = PackIndex.build(cu_from_lengths(lengths), block, lengths)
    bad = TopKGate.score(q * 3, k, GateTables.of(pack, Budget(top_k=0)), 16**-0.5)
    mask = bad.layout(Budget(top_k=1)).block_mask
    assert bool(mask[2:, 3:8, 3].all()), "later query blocks must keep the non-finite key block"
    clean = TopKGate.score(q * 3, k.nan_to_num(0.0), bad.tables, 16**-0.5)
    assert torch.equal(mask[:, 8:], clean.layout(Budget(top_k=1)).block_mask[:, 8:])


def test_many_short_scored_documents_fall_back_to_the_per_document_batches():
    lengths = (20,) * 400  # 1-2 segments each at block 32: ~650 scored segments, 250 blocks
    pack = PackIndex.build(cu_from_lengths(lengths), 32, lengths)
    lowest = Budget(top_k=0, sink_blocks=0, local_blocks=0)
    assert GateTables.of(pack, lowest) is None
    q, k, _ = make_qkv(sum(lengths), 2, 1, 16, requires_grad=False)
    layout = select_blocks(q, k, cu_from_lengths(lengths), lowest, block_size=32)
    assert layout.num_blocks == pack.num_blocks  # the per-document estimate made it


def test_a_budget_the_tables_were_not_built_for_is_refused():
    """The tables hold the lowest budget's anchors, min_blocks and k: anything else would keep
    the wrong blocks silently (a document with no key at all, anchors lost)."""
    lengths = (300, 700)
    q, k, _ = make_qkv(sum(lengths), 4, 2, 16, requires_grad=False)
    pack = PackIndex.build(cu_from_lengths(lengths), 32, lengths)
    gate = TopKGate.score(q, k, GateTables.of(pack, Budget(top_k=4)), 16**-0.5)
    gate.layout(Budget(top_k=6))  # above the lowest: served
    for bad in (
        Budget(top_k=0),
        Budget(top_k=6, local_blocks=3),
        Budget(top_k=6, min_blocks=2),
        Budget(top_k=6, max_density=0.5),
    ):
        with pytest.raises(ValueError, match="the gate's tables were built for budgets from"):
            gate.layout(bad)
    with pytest.raises(ValueError, match="k from 2"):
        gate.coverage_floor(Budget(top_k=8), (2, 3, 8), 0.1)
