"""The SparseBalance paper's DST rule on hand-made workers: cut to the anchor within the coverage
bound p, the empty feasible set, p = 0, raises up to the anchor, every anchor; and the same rule
through the layer controller on a real gate (top-k)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.ops import Budget, estimate_block_mass
from sparsebalance.tuning import DSTConfig, DSTTuner, LayerController, TopKKnob
from sparsebalance.workload import MicroBatch
from tests.conftest import cu_from_lengths, make_qkv

from .oracle import Oracle

KNOB = TopKKnob(base=8, lo=2, hi=64, block_size=64)


class HandWork:
    """Workers with ``T_w(k) = t_w + s_w (k - 8)`` seconds and gate coverage
    ``C_w(k) = min(1, c0_w + c1_w k)``: the rule's inputs, chosen by hand."""

    def __init__(self, t, s, c0=None, c1=None):
        self.t, self.s = np.asarray(t, float), np.asarray(s, float)
        n = self.t.size
        self.c0 = np.zeros(n) if c0 is None else np.asarray(c0, float)
        self.c1 = np.full(n, 0.01) if c1 is None else np.asarray(c1, float)
        self.num_ranks, self.knob = n, KNOB
        self.max_lengths = np.full(n, 1 << 20)
        self.has_coverage = True

    def seconds(self, v, active=None):
        out = self.t + self.s * (np.asarray(v, float) - 8)
        return out if active is None else np.where(active, out, 0.0)

    def coverage(self, v, active=None):
        out = np.minimum(1.0, self.c0 + self.c1 * np.asarray(v, float))
        return out if active is None else np.where(active, out, 1.0)

    def mean_density(self, v):
        return np.asarray(v, float) / 100

    def attention_seconds(self, v):
        return self.s * np.asarray(v, float)


def decide(work, **cfg):
    """The paper's rule: raises trust the model (``skew_margin`` 1) unless a test says otherwise."""
    cfg = {"skew_margin": 1.0, **cfg}
    return DSTTuner(DSTConfig(budget_tokens=512, **cfg), knob=KNOB).decide_arrays(work)


def test_cuts_to_the_anchor_and_raises_up_to_it():
    work = HandWork(t=[10, 20, 30], s=[1, 1, 2])  # mean anchor 20
    a = decide(work)
    assert a.targets.anchor_seconds == 20 and a.targets.raise_seconds == 20
    assert a.targets.roles == ("raised", "kept", "cut")
    assert a.budgets[2] == pytest.approx(3.0, abs=1e-3)  # 30 + 2 (k - 8) <= 20
    assert a.budgets[0] == pytest.approx(18.0, abs=1e-3)  # 10 + (k - 8) <= 20
    assert a.budgets[1] == 8
    assert a.times_after.max() <= 20 + 1e-9
    assert a.times_after[2] == pytest.approx(20, abs=1e-3)


def test_the_skew_margin_stops_a_raise_where_a_skewed_model_would_overshoot():
    """Worker 0 (rest 2 s, attention k s) raised to k 18 meets the anchor by the model, but if
    attention cost 2x it would take 38 s, past every other worker (at 2x: 28 s kept, 26 s cut);
    with margin 2 it stops at the k where it still stays below the kept worker at both ends of
    the skew range: 2 + 2k <= 12 + 16 (k 13) and 2 + k / 2 <= 12 + 4 (k 28): k = 13."""
    work = HandWork(t=[10, 20, 30], s=[1, 1, 2])
    a = decide(work, skew_margin=2.0)
    assert a.budgets[0] == pytest.approx(13.0, abs=1e-3)
    assert a.budgets[2] == pytest.approx(3.0, abs=1e-3)  # the cut is the same
    assert a.times_after.max() <= 20 + 1e-9


def test_the_coverage_bound_stops_a_cut_empty_feasible_set():
    """Worker 2 would need k = 3, but C(8) - C(k) <= 0.1 only for k >= 6: F is empty, so it is
    cut as far as the bound allows (k = 6) and misses the anchor; others are still raised."""
    work = HandWork(t=[10, 20, 30], s=[1, 1, 2], c0=[0, 0, 0.5], c1=[0.01, 0.01, 0.05])
    a = decide(work, p=0.1)
    assert a.targets.roles[2] == "cut"
    assert a.budgets[2] == pytest.approx(6.0, abs=1e-3)
    assert a.times_after[2] == pytest.approx(26.0, abs=1e-2)
    loss = work.coverage(np.full(3, 8.0)) - work.coverage(a.budgets)
    assert loss[2] <= 0.1 + 1e-9
    assert a.budgets[0] == pytest.approx(18.0, abs=1e-3)  # raised to the anchor, not to 26
    # with a looser bound the same worker reaches the anchor
    a = decide(work, p=0.3)
    assert a.budgets[2] == pytest.approx(3.0, abs=1e-3)


def test_the_knobs_floor_also_empties_the_feasible_set():
    work = HandWork(t=[10, 40], s=[1, 1], c1=[0.0, 0.0])  # coverage flat: the bound never binds
    a = decide(work, p=0.1)  # anchor 25; worker 1 needs k = -7 < k_min = 2
    assert a.budgets[1] == 2 and a.times_after[1] == pytest.approx(34.0)
    assert a.targets.post_cut_seconds == pytest.approx(34.0)


def test_p_zero_never_compresses_below_the_base():
    work = HandWork(t=[10, 20, 30], s=[1, 1, 2], c1=[0.0, 0.0, 0.0])  # cutting loses nothing
    a = decide(work, p=0.0)
    assert np.all(a.budgets >= 8)
    assert a.times_after[2] == 30  # the bottleneck keeps its time
    assert a.budgets[0] == pytest.approx(18.0, abs=1e-3)  # raising is not compression


@pytest.mark.parametrize(
    "anchor, roles, after",
    [
        ("min", ("kept", "cut", "cut"), [10, 14, 18]),  # k_min = 2 reached: 20-6, 30-12
        ("median", ("raised", "kept", "cut"), [20, 20, 20]),
        ("max", ("raised", "raised", "kept"), [30, 30, 30]),
    ],
)
def test_anchors(anchor, roles, after):
    work = HandWork(t=[10, 20, 30], s=[1, 1, 2], c1=[0.0, 0.0, 0.0])
    a = decide(work, anchor=anchor, p=0.5)
    assert a.targets.roles == roles
    np.testing.assert_allclose(a.times_after, after, atol=1e-3)


def test_modes_and_the_old_time_band():
    work = HandWork(t=[10, 20, 30], s=[1, 1, 2], c1=[0.0, 0.0, 0.0])
    assert np.all(decide(work, mode="off").budgets == 8)
    down = decide(work, mode="down")
    assert down.budgets[0] == 8 and down.budgets[2] < 8
    # tolerance 0.1 + raise_to step (our earlier rule): the cut aims at 22, raises go to T' = 22
    band = decide(work, tolerance=0.1, raise_to="step")
    assert band.targets.cut_threshold == pytest.approx(22.0)
    assert band.times_after[2] == pytest.approx(22.0, abs=1e-3)
    assert band.times_after[0] == pytest.approx(22.0, abs=1e-3)
    assert band.times_after[1] == pytest.approx(22.0, abs=1e-3)  # below T': raised too


def test_per_rank_reference_matches_the_vectorised_rule_on_top_k():
    oracle = Oracle()
    rng = np.random.default_rng(3)
    plan = [[MicroBatch((i,), (int(n),), (0.5,))] for i, n in enumerate(rng.integers(1000, 16000, 6))]
    tuner = DSTTuner(DSTConfig(budget_tokens=1024, skew_margin=1.0), block_size=64)
    dec = tuner.decide(plan, oracle)
    assert {r.role for r in dec.ranks} >= {"cut", "raised"}
    for r, mbs in enumerate(plan):
        assert tuner.decide_rank(r, mbs, oracle, dec.targets) == dec.ranks[r]


def _gate(seed=0, lengths=(2048, 1024)):
    q, k, _ = make_qkv(sum(lengths), 2, 1, 16, dtype=torch.float32, seed=seed, requires_grad=False)
    return estimate_block_mass(q * 2.0, k, cu_from_lengths(lengths), block_size=64), lengths


def test_layer_controller_runs_whole_k_within_the_coverage_bound():
    """A rank asked for far less time than its base budget costs: each layer cuts k (a whole
    number) only as far as C(base) - C(k) <= p, and says when the bound stopped it."""
    est, lengths = _gate()
    oracle = Oracle(num_layers=3, a=0.0, b=1e-6, c=0.0, overhead=0.0)
    mb = MicroBatch((0, 1), lengths, (0.5, 0.5))
    cfg = DSTConfig(budget_tokens=1024, p=0.05)  # base k = 16 at block 64
    knob = cfg.knob(64)
    ctl = LayerController([mb], oracle, cfg, target_seconds=1e-9, knob=knob, device="cpu")
    for layer in range(3):
        budget = ctl.choose(0, layer, est)
        assert isinstance(budget.top_k, int) and budget.top_k < knob.base
        rec = ctl.records[-1]
        base_cov = est.coverage(Budget(top_k=knob.base))
        assert base_cov - est.coverage(budget) <= 0.05 + 1e-9
        assert est.coverage(budget.with_value(budget.top_k - 1)) < base_cov - 0.05
        assert rec.coverage_limited and rec.coverage == pytest.approx(est.coverage(budget))
    # with no bound (p = 1) the same layers cut to the floor
    loose = LayerController([mb], oracle, DSTConfig(budget_tokens=1024, p=1.0), 1e-9, knob=knob, device="cpu")
    assert loose.choose(0, 0, est).top_k == knob.lo


def test_layer_controller_realizes_a_fractional_step_budget():
    """A step-level k of 9.5 (a mean over layers): on plan, the layers run 9s and 10s."""
    est, lengths = _gate(seed=1)
    oracle = Oracle(num_layers=8, a=0.0, b=1e-6, c=0.0, overhead=0.0)
    mb = MicroBatch((0, 1), lengths, (0.5, 0.5))
    cfg = DSTConfig(budget_tokens=512, p=1.0)
    knob = cfg.knob(64)
    ctl = LayerController([mb], oracle, cfg, 0.0, value=9.5, knob=knob, device="cpu")
    ctl.target_seconds = float(ctl.planned.sum())
    ks = [ctl.choose(0, layer, est).top_k for layer in range(8)]
    assert set(ks) <= {9, 10} and 9 in ks and 10 in ks
    assert np.mean(ks) == pytest.approx(9.5, abs=0.26)


def _topk_gate(seed=0, lengths=(2048, 1024)):
    """The one-batch top-k gate (what a training layer uses) of the same q, k as :func:`_gate`."""
    from sparsebalance.ops.pack_index import PackIndex
    from sparsebalance.ops.topk_gate import GateTables, TopKGate

    q, k, _ = make_qkv(sum(lengths), 2, 1, 16, dtype=torch.float32, seed=seed, requires_grad=False)
    pack = PackIndex.build(cu_from_lengths(lengths), 64, lengths)
    tables = GateTables.of(pack, Budget(top_k=0))
    return TopKGate.score(q * 2.0, k, tables, 16**-0.5), lengths


@pytest.mark.parametrize("gate", [_gate, _topk_gate], ids=["per-document", "one-batch"])
def test_the_coverage_bound_decided_on_the_device_runs_the_same_k_without_a_read_back(gate):
    """Issue 38, item 3: on a GPU the layer controller's coverage bound is decided on the device
    (``v_cov`` a device scalar, the layer running ``max(v_time, v_cov)``), so no layer waits for
    the device; the layout is the host decision's, the record reads back at the step's end.
    The device is the controller's ``device`` (a CUDA run's, the tensors stay on the CPU)."""
    from sparsebalance.launches import LaunchCounter

    est, lengths = gate()
    oracle = Oracle(num_layers=3, a=0.0, b=1e-6, c=0.0, overhead=0.0)
    mb = MicroBatch((0, 1), lengths, (0.5, 0.5))
    cfg = DSTConfig(budget_tokens=1024, p=0.05)
    knob = cfg.knob(64)
    host = LayerController([mb], oracle, cfg, target_seconds=1e-9, knob=knob, device="cpu")
    device = LayerController([mb], oracle, cfg, target_seconds=1e-9, knob=knob, device="cuda")
    want = host.choose(0, 0, est)
    with LaunchCounter() as rec:
        got = device.choose(0, 0, est)
        layout = est.layout(got)
    assert not rec.reads, rec.reads
    assert got.floor is not None and got.top_k < want.top_k  # the time choice, raised on device
    assert torch.equal(layout.block_mask, est.layout(want).block_mask)
    record = device.records[-1]
    assert record.chosen == want.top_k and bool(record.coverage_limited)
    assert device.num_coverage_limited == 1 and device.summary().budget_min == want.top_k
