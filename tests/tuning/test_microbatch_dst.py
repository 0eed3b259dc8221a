"""DST's micro-batch level inside pipelines (``tuning.microbatch_dst``): with P > 1 every
micro-batch gets its own budget, the critical one cut and the others raised, no pipeline predicted
slower than with one budget, each cut within its own coverage bound; P = 1 is unchanged."""

import numpy as np
import pytest

from sparsebalance.simulate.pipeline import one_f_one_b, split_forward_backward, stage_seconds
from sparsebalance.simulate.sparsity import CoverageModel
from sparsebalance.tuning import DSTConfig, DSTTuner, LayerController, PipelineWorkload, PlanWorkload

from .test_pipeline_dst import PLAN, EightLayers, mb, pipe

# Two equal pipelines (SAB's outcome): nothing for one budget per pipeline to move, but each has
# one critical micro-batch (three long documents) and three short ones that may be raised.
EVEN = [[mb(3000, 3000, 3000), mb(1500), mb(1500), mb(1500)]] * 2


def tuner(mode="bidirectional", p=0.5, anchor="mean"):
    return DSTTuner(DSTConfig(mode=mode, anchor=anchor, p=p, budget_tokens=512), block_size=64)


def padded(mbs):
    n = max(len(m.lengths) for m in mbs)
    lengths = np.array([list(m.lengths) + [0] * (n - len(m.lengths)) for m in mbs])
    d0 = np.array([list(m.densities) + [1.0] * (n - len(m.densities)) for m in mbs])
    return lengths, d0


def makespan(cost, mbs, knob, values, stages=4):
    """The simulator's exact 1F1B makespan at one budget per micro-batch."""
    lengths, d0 = padded(mbs)
    dens = knob.density(lengths, d0, np.asarray(values, dtype=np.float64)[:, None])
    return one_f_one_b(*split_forward_backward(stage_seconds(cost, lengths, dens, stages))).makespan


def coverage(model, mbs, values):
    """``(M,)`` each micro-batch's token-weighted coverage at its budget."""
    lengths, d0 = padded(mbs)
    cov = model.document_coverage(lengths, d0, np.asarray(values, dtype=np.float64)[:, None])
    return (np.where(lengths > 0, cov, 0.0) * lengths).sum(-1) / lengths.sum(-1)


@pytest.mark.parametrize("plan", [PLAN, EVEN], ids=["uneven", "even"])
def test_one_stage_and_mode_off_have_no_microbatch_budgets(plan):
    cost, t = EightLayers(), tuner()
    flat = t.decide(plan, cost)
    assert flat == t.decide(plan, cost, pipeline=None)
    assert all(r.microbatch_budgets is None for r in flat.ranks)
    assert t.decide_arrays(PlanWorkload(plan, cost, t.knob)).microbatch_budgets is None
    off = tuner("off").decide(plan, cost, pipeline=pipe(4))
    assert all(r.microbatch_budgets is None for r in off.ranks)


def test_the_critical_microbatch_is_cut_the_others_raised():
    cost, t = EightLayers(), tuner()
    one = t.decide(EVEN, cost, pipeline=pipe(4), per_microbatch=False)
    assert one.budgets.tolist() == [t.base, t.base]  # even pipelines: one budget moves nothing
    per = t.decide(EVEN, cost, pipeline=pipe(4))
    for r, dec in enumerate(per.ranks):
        v = dec.microbatch_budgets
        assert len(v) == 4 and v[0] < t.base < min(v[1:])
        assert dec.budget == pytest.approx(np.mean(v))
        exact = makespan(cost, EVEN[r], t.knob, v)
        assert dec.predicted_after == pytest.approx(exact, rel=1e-9)
        assert exact < 0.9 * one.ranks[r].predicted_after  # strictly (here by > 10 %) faster
    assert per.step_seconds_after < one.step_seconds_after


def test_never_slower_than_one_budget_per_pipeline():
    cost = EightLayers()
    for mode in ("bidirectional", "down"):
        for anchor in ("min", "mean", "max"):
            for p in (0.0, 0.05, 0.5):
                t = tuner(mode, p, anchor)
                one = t.decide(PLAN, cost, pipeline=pipe(4), per_microbatch=False)
                per = t.decide(PLAN, cost, pipeline=pipe(4))
                assert np.all(per.times_after <= one.times_after), (mode, anchor, p)
                for dec in per.ranks:
                    assert min(dec.microbatch_budgets) >= t.knob.lo
                    if mode == "down":
                        assert max(dec.microbatch_budgets) <= t.base
                    if p == 0.0:  # nothing may be cut below the base
                        assert min(dec.microbatch_budgets) >= t.base


@pytest.mark.parametrize("p", [0.02, 0.05, 0.2])
def test_each_microbatch_cut_stays_within_its_coverage_bound(p):
    cost, t = EightLayers(), tuner(p=p)
    model = CoverageModel(t.knob.density, 0.9)
    plan = [[mb(3000, 3000, 3000, density=0.2), mb(1500, density=0.4), mb(1500), mb(1500)]] * 2
    work = PipelineWorkload(PlanWorkload(plan, cost, t.knob, coverage=model), pipe(4))
    one = t.decide_arrays(work, per_microbatch=False)
    per = t.decide_arrays(work)
    for r in range(2):
        v = per.microbatch_budgets[r]
        lost = coverage(model, plan[r], np.full(4, t.base)) - coverage(model, plan[r], v)
        assert np.all(lost <= p + 1e-9)
        assert v[0] < t.base  # the critical micro-batch is cut, as far as its bound allows
        assert min(v[1:]) > t.base  # the short ones are raised, never cut to pay for it
        assert per.times_after[r] <= one.times_after[r]


def test_a_tighter_bound_cuts_less():
    cost = EightLayers()
    spans = []
    for p in (0.01, 0.05, 0.3):
        t = tuner(p=p)
        model = CoverageModel(t.knob.density, 0.9)
        work = PipelineWorkload(PlanWorkload(EVEN, cost, t.knob, coverage=model), pipe(4))
        spans.append(t.decide_arrays(work).times_after.max())
    assert spans[0] >= spans[1] >= spans[2]
    assert spans[0] > spans[2]


def test_layer_controller_plans_each_microbatch_at_its_budget():
    cost, t = EightLayers(), tuner()
    dec = t.decide(EVEN, cost, pipeline=pipe(4)).ranks[0]
    ctl = LayerController.from_decision(dec, EVEN[0], cost, t.config, knob=t.knob, device="cpu")
    assert ctl.values.tolist() == list(dec.microbatch_budgets)
    assert ctl.lo <= min(dec.microbatch_budgets) and max(dec.microbatch_budgets) <= ctl.hi
    for m, v in enumerate(dec.microbatch_budgets):
        alone = LayerController([EVEN[0][m]], cost, t.config, 0.0, value=v, knob=t.knob, device="cpu")
        assert ctl.planned[m] == pytest.approx(alone.planned[0], rel=1e-12)
    with pytest.raises(ValueError, match="3 budgets for 4 micro-batches"):
        LayerController(EVEN[0], cost, t.config, 1.0, values=(8.0, 8.0, 8.0), knob=t.knob, device="cpu")
    # one budget for the rank: every micro-batch planned at it (P = 1, as before)
    flat = LayerController(EVEN[0], cost, t.config, 1.0, value=9.0, knob=t.knob, device="cpu")
    assert flat.values.tolist() == [9.0] * 4
