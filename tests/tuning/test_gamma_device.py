"""Issue 53, item 2: gamma budgets decide on the device as top-k does. The coverage of the gamma
rule at a grid of gammas in fixed-shape device work (equal to the rule's own coverage), a
``floor`` that raises gamma on the device, and the layer controller of a CUDA run: no host read
per layer, the layer running the smallest grid gamma within the coverage bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.launches import LaunchCounter
from sparsebalance.ops import Budget, estimate_block_mass
from sparsebalance.tuning import DSTConfig, LayerController
from sparsebalance.workload import MicroBatch
from tests.conftest import cu_from_lengths, make_qkv

from .oracle import Oracle

LENGTHS = (1500, 200, 77, 1100)
GAMMA = DSTConfig(budget="gamma", gamma0=0.9, gamma_min=0.5, gamma_max=0.99, p=0.05)


def _estimate(lengths=LENGTHS, seed=0):
    q, k, _ = make_qkv(sum(lengths), 4, 2, 16, dtype=torch.float32, seed=seed, requires_grad=False)
    return estimate_block_mass(q * 3.0, k, cu_from_lengths(lengths), block_size=64)


@pytest.mark.parametrize(
    "budget",
    [
        Budget(gamma=0.9),
        Budget(gamma=0.9, sink_blocks=2, local_blocks=2, min_blocks=3),
        Budget(gamma=0.9, sink_blocks=0),
    ],
    ids=["anchors-1-1", "anchors-2-2-min-3", "no-sink"],
)
def test_the_gamma_coverage_curve_on_the_device_is_the_rules_coverage(budget):
    est = _estimate()
    grid = np.linspace(0.3, 0.95, 14)
    got = est.coverage_curve_tensor(budget, grid).numpy()
    want = np.array([est.coverage(budget.with_value(g)) for g in grid])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    assert np.all(np.diff(got) >= -1e-12)  # non-decreasing: searchsorted finds the bound


def test_a_gamma_floor_keeps_what_the_larger_gamma_keeps():
    est = _estimate()
    for gamma, floor in ((0.6, 0.8), (0.8, 0.6)):
        raised = Budget(gamma=gamma, floor=torch.tensor(floor, dtype=torch.float64))
        want = Budget(gamma=max(gamma, floor))
        assert torch.equal(est.block_mask(raised), est.block_mask(want))


def test_the_gamma_coverage_bound_is_decided_on_the_device_without_a_read_back():
    """A rank far over its target: the time choice is the knob's floor; the coverage bound
    raises it, on the device, to the smallest grid gamma within ``p`` of the base's coverage."""
    est = _estimate()
    mb = MicroBatch(tuple(range(len(LENGTHS))), LENGTHS, (0.4,) * len(LENGTHS))
    oracle = Oracle(num_layers=2, a=0.0, b=1e-6, c=0.0, overhead=0.0)
    knob = GAMMA.knob(64)
    ctl = LayerController([mb], oracle, GAMMA, target_seconds=1e-9, knob=knob, device="cuda")
    with LaunchCounter() as count:
        got = ctl.choose(0, 0, est)
        est.layout(got)
    assert not count.reads, count.reads
    assert got.gamma == knob.lo and got.floor is not None  # the time choice, raised on the device
    grid, base = ctl._bound
    covered = np.array([est.coverage(base.with_value(g)) for g in grid])
    want = grid[int(np.searchsorted(covered, covered[-1] - GAMMA.p))]
    assert float(got.floor) == pytest.approx(want, abs=1e-12)
    assert covered[-1] - est.coverage(Budget(gamma=float(got.floor))) <= GAMMA.p + 1e-9
    record = ctl.records[-1]
    assert record.chosen == pytest.approx(want) and bool(record.coverage_limited)


def test_a_gamma_layer_of_a_cuda_run_reads_nothing_back():
    """The whole layer (the ``sparsebalance`` attention with DST's controller of a CUDA run,
    tensors on the CPU): selection, decision and attention without a read (issue 53: 26 reads
    per cut layer before, ``count_gamma_reads.py``)."""
    from sparsebalance.engine.layers import packed_attention
    from sparsebalance.models.attention import sparsebalance_attention

    class Module:
        def __init__(self, layer):
            self.layer_idx = layer

    lengths = LENGTHS
    mb = MicroBatch(tuple(range(len(lengths))), lengths, (0.4,) * len(lengths))
    oracle = Oracle(num_layers=2, a=0.0, b=1e-6, c=0.0, overhead=0.0)
    knob = GAMMA.knob(64)
    ctl = LayerController([mb], oracle, GAMMA, target_seconds=1e-9, knob=knob, device="cuda")
    base = knob.budget(Budget(gamma=1.0), knob.base)
    ctx = packed_attention(cu_from_lengths(lengths), lengths, base, block_size=64, backend="torch", controller=ctl, m=0)
    q, k, v = make_qkv(sum(lengths), 4, 2, 16, dtype=torch.float32, requires_grad=False)
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    for layer in range(2):
        with LaunchCounter() as count:
            sparsebalance_attention(Module(layer), qh, kh, vh, None, sb_attention=ctx)
        assert not count.reads, (layer, count.reads)
    assert all(r.floor is not None for r in ctl.records)
    assert all(0 < d < 1 for d in (s.density for s in ctx.stats))
