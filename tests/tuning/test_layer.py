"""Layer-level DST: the closed-loop controller on synthetic layers and on a real estimate."""

import numpy as np
import pytest
import torch

from sparsebalance.ops import Budget, estimate_block_mass
from sparsebalance.tuning import DensityCurve, DSTTuner, LayerController
from sparsebalance.workload import MicroBatch
from tests.conftest import cu_from_lengths, make_qkv

from .gamma_rule import G
from .oracle import Oracle, random_plan

L = 6
ORACLE = Oracle(num_layers=L)


class SyntheticEstimate:
    """One layer's real density response: the curve's shape, scaled per layer by ``shift``
    (the layer is sparser or denser than the planner predicted), pack density length²-weighted."""

    def __init__(self, mb, shift, gamma0=0.9):
        self.lengths = np.asarray(mb.lengths, dtype=np.float64)
        self.d0 = np.asarray(mb.densities)
        self.shift = shift
        self.curve = DensityCurve(gamma0)

    def doc_densities(self, gamma):
        return np.maximum(self.curve.density(self.d0, gamma) ** self.shift, 1e-12)

    def density(self, budget: Budget) -> float:
        w = self.lengths**2
        return float(w @ self.doc_densities(budget.gamma) / w.sum())

    # the LayerGate protocol: the pack's density for every document, and no coverage lost
    def document_density(self, budget: Budget) -> torch.Tensor:
        return torch.full((self.lengths.size,), self.density(budget), dtype=torch.float64)

    def coverage(self, budget: Budget) -> float:
        return 1.0

    def coverage_curve(self, budget: Budget, ks) -> np.ndarray:
        return np.ones(len(ks))

    def coverage_floor(self, budget: Budget, ks, p: float) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int64)

    def keeps_whole(self, budget: Budget) -> bool:
        return False


def run_rank(ctl, mbs, slow=lambda m, layer: 1.0, seed=0):
    """Drive the controller like a forward pass; the oracle's seconds are scaled by ``slow``."""
    rng = np.random.default_rng(seed)
    shifts = rng.uniform(0.8, 1.25, size=(len(mbs), L))
    for m, mb in enumerate(mbs):
        for layer in range(L):
            est = SyntheticEstimate(mb, shifts[m, layer])
            budget = ctl.choose(m, layer, est)
            dens = est.doc_densities(budget.gamma)
            sec = ORACLE.layer_attention_seconds(mb.lengths, dens).sum()
            sec += ORACLE.layer_other_seconds(mb.num_tokens)
            sec += ORACLE.microbatch_overhead() if layer == 0 else 0.0
            ctl.observe(m, layer, sec * slow(m, layer))
    return ctl.summary()


def _rank(seed=0):
    plan = random_plan(np.random.default_rng(seed), 4, mbs_per_rank=3, lengths=(2048, 8192))
    dec = DSTTuner(G(), block_size=64).decide(plan, ORACLE)
    return dec, plan


def early_slow(m, layer):
    return 1.3 if layer < L // 3 else 1.0


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_closed_loop_compensates_slow_early_layers(rank):
    dec, plan = _rank()
    cfg = G()
    ctl = LayerController.from_decision(dec.ranks[rank], plan[rank], ORACLE, cfg, knob=cfg.knob(64), device="cpu")
    summary = run_rank(ctl, plan[rank], slow=early_slow)
    assert abs(summary.relative_error) < 0.05, summary
    # later layers paid for it: they run at a lower budget than the early ones
    early = np.mean(summary.layer_budget_mean[: L // 3])
    late = np.mean(summary.layer_budget_mean[L // 3 :])
    assert late < early
    assert all(cfg.gamma_min <= r.budget <= cfg.gamma_max for r in ctl.records)

    # the same rank without feedback (fixed step gamma) misses by more than 5%
    off = G(mode="off", gamma0=0.9)
    open_loop = LayerController.from_decision(dec.ranks[rank], plan[rank], ORACLE, off, knob=off.knob(64), device="cpu")
    open_loop.value = open_loop.lo = open_loop.hi = dec.ranks[rank].budget
    assert run_rank(open_loop, plan[rank], slow=early_slow).relative_error > 0.05


def test_closed_loop_gives_budget_back_when_early_layers_are_cheap():
    dec, plan = _rank(seed=1)
    r = min(dec.ranks, key=lambda r: r.budget)  # a cut rank: room to go up to gamma_max
    assert r.role == "cut"
    ctl = LayerController.from_decision(r, plan[r.rank], ORACLE, G(), knob=G().knob(64), device="cpu")
    summary = run_rank(ctl, plan[r.rank], slow=lambda m, layer: 0.7 if layer < L // 3 else 1.0)
    assert abs(summary.relative_error) < 0.05
    assert summary.budget_max > r.budget


def test_down_never_raises_and_off_is_fixed():
    dec, plan = _rank(seed=2)
    for mode, check in (
        ("down", lambda g: g <= 0.9),
        ("off", lambda g: g == 0.9),
    ):
        cfg = G(mode=mode)
        ctl = LayerController(plan[0], ORACLE, cfg, dec.ranks[0].target_seconds * 2, knob=cfg.knob(64), device="cpu")
        run_rank(ctl, plan[0], slow=lambda m, layer: 0.5)
        assert all(check(rec.budget) for rec in ctl.records), mode


def test_on_plan_stays_near_step_gamma():
    """When every layer behaves as predicted, the controller keeps the step's gamma."""
    plan = [[MicroBatch((0, 1), (4096, 3000), (0.3, 0.2))] * 2]
    dec = DSTTuner(G(), block_size=64).decide(plan, ORACLE)
    cfg = G(layer_probes=12)
    ctl = LayerController.from_decision(dec.ranks[0], plan[0], ORACLE, cfg, knob=cfg.knob(64), device="cpu")
    for m, mb in enumerate(plan[0]):
        for layer in range(L):
            est = SyntheticEstimate(mb, 1.0)
            budget = ctl.choose(m, layer, est)
            assert budget.gamma == pytest.approx(dec.ranks[0].budget, abs=0.01)
            ctl.observe(m, layer, ctl.records[-1].predicted_seconds)
    assert abs(ctl.summary().relative_error) < 0.01


def test_real_block_mass_estimate():
    """With a real BlockMassEstimate the controller prices per-document densities of real
    layouts, and the recorded density is the layout's."""
    lengths = (200, 97, 300)
    q, k, _ = make_qkv(sum(lengths), 2, 1, 16, dtype=torch.float32, requires_grad=False)
    cu = cu_from_lengths(lengths)
    est = estimate_block_mass(q, k, cu, block_size=16)
    d0 = est.layout(Budget(gamma=0.9)).document_density().numpy()
    mb = MicroBatch((0, 1, 2), lengths, tuple(float(x) for x in d0))
    model = Oracle(num_layers=2, a=0.0, b=1e-6, c=0.0, overhead=0.0)
    full = float(model.predict(lengths, 1.0))
    cfg = G(gamma_min=0.3)
    ctl = LayerController([mb], model, cfg, target_seconds=0.6 * full, knob=cfg.knob(64), device="cpu")
    budget = ctl.choose(0, 0, est, spent_seconds=0.0)
    rec = ctl.records[0]
    layout = est.layout(budget)
    w = np.asarray(lengths, dtype=np.float64) ** 2
    assert rec.density == pytest.approx(w @ layout.document_density().numpy() / w.sum())
    assert rec.predicted_seconds <= rec.allotted_seconds or budget.gamma == 0.3
    assert 0.3 <= budget.gamma <= 0.99


def test_bad_calls_raise():
    dec, plan = _rank()
    ctl = LayerController.from_decision(dec.ranks[0], plan[0], ORACLE, G(), knob=G().knob(64), device="cpu")
    est = SyntheticEstimate(plan[0][0], 1.0)
    with pytest.raises(ValueError, match="never chosen"):
        ctl.observe(0, 0, 1.0)
    ctl.choose(0, 0, est)
    with pytest.raises(ValueError, match="already chosen"):
        ctl.choose(0, 0, est)
    with pytest.raises(ValueError, match="outside"):
        ctl.choose(0, L, est)
    with pytest.raises(ValueError, match="target_seconds"):
        LayerController(plan[0], ORACLE, G(), float("nan"), knob=G().knob(64), device="cpu")


def test_units_add_up_to_the_latency_models_prediction():
    """On the real LatencyModel the planned units of a micro-batch sum to predict(): a rank exactly
    on target keeps its step gamma instead of being cut to the floor."""
    from sparsebalance.latency import LatencyModel, analytic_profile
    from sparsebalance.models import load_shapes
    from sparsebalance.tuning import DensityCurve, LayerController
    from sparsebalance.workload import MicroBatch

    model = LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=64))
    cfg = G(mode="bidirectional", gamma0=0.9)
    mbs = [MicroBatch((0, 1), (3000, 900), (0.3, 0.6)), MicroBatch((2,), (2500,), (0.2,))]
    curve = DensityCurve(gamma0=0.9)
    target = sum(model.predict(mb.lengths, curve.density(np.array(mb.densities), 0.9)) for mb in mbs)
    ctl = LayerController(mbs, model, cfg, target, value=0.9, knob=cfg.knob(64, curve), device="cpu")
    assert ctl.planned.sum() == pytest.approx(target, rel=1e-9)


@pytest.mark.parametrize("num_layers", [1, 2, 6])
def test_units_add_up_for_any_number_of_layers(num_layers):
    """A one-layer model has no second layer to read the per-layer time from (it crashed)."""
    oracle = Oracle(num_layers=num_layers)
    mbs = [MicroBatch((0, 1), (3000, 900), (0.3, 0.6)), MicroBatch((2,), (2500,), (0.2,))]
    curve = DensityCurve(gamma0=0.9)
    target = sum(oracle.predict(mb.lengths, curve.density(np.array(mb.densities), 0.9)) for mb in mbs)
    cfg = G(mode="bidirectional", gamma0=0.9)
    ctl = LayerController(mbs, oracle, cfg, target, value=0.9, knob=cfg.knob(64, curve), device="cpu")
    assert ctl.planned.shape == (2, num_layers)
    assert ctl.planned.sum() == pytest.approx(target, rel=1e-9)
