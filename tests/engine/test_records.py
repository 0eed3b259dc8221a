"""The step's typed records: the metrics.jsonl schema is kept, and the feedback stage teaches the
density estimator through the curve's inverse (gamma-1 layers carry no signal)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.engine.feedback import apply_feedback
from sparsebalance.engine.records import MicroBatchResult, RankRecord, StepFeedback
from sparsebalance.tuning import DensityCurve, DSTConfig, RankDecision
from sparsebalance.workload import Sample

# metrics.jsonl per-rank fields, in order (the report reads them); before the top-k budgets the
# budget fields were named gamma, gamma_min, gamma_mean, gamma_max (the report reads both).
LEGACY_RANK_FIELDS = [
    "rank",
    "compute_s",
    "tokens",
    "microbatch_s",
    "predicted_before_s",
    "predicted_s",
    "budget",
    "dst_role",
    "target_s",
    "budget_min",
    "budget_mean",
    "budget_max",
    "density",
    "bubble_s",
    "sync_s",
    "derived_bubble_s",
]


def _mb(ids, lengths, dens, gammas, seconds=0.5):
    return MicroBatchResult(seconds, tuple(lengths), tuple(ids), dens, tuple(gammas), 3.0, 2.0)


def _decision(rank=1):
    return RankDecision(rank, "raised", 0.95, 1.2, 1.0, 1.2, 0.4, 0.5, 0.3, 0.4)


def test_rank_record_keeps_the_jsonl_schema_and_aggregates():
    a = _mb([4, 7], [10, 20], ((0.5, 0.25), (0.5, 0.75)), [0.9, 0.99], seconds=0.5)
    b = _mb([9], [5], ((1.0,), (0.5,)), [0.8, 0.95], seconds=0.25)
    rec = RankRecord.from_results(_decision(), [a, b])
    out = rec.to_json()
    assert list(out) == [
        *LEGACY_RANK_FIELDS,
        "ring_wait_s",
        "units",
        "dst_layer_s",
        "coverage_limited",
        "stages",
    ]  # new fields appended
    assert out["stages"] == []  # a pipeline's per-stage busy and idle; none without one
    assert [u["slot"] for u in out["units"]] == [-1, -1] and out["ring_wait_s"] == 0.0
    assert out["units"][0]["degree"] == 1 and out["units"][0]["sample_ids"] == [4, 7]
    assert out["compute_s"] == 0.75 and out["tokens"] == 35 and out["microbatch_s"] == [0.5, 0.25]
    assert (out["budget_min"], out["budget_max"]) == (0.8, 0.99)
    assert out["budget_mean"] == pytest.approx(np.mean([0.9, 0.99, 0.8, 0.95]))
    # length²-weighted: per layer over documents, mean over layers, then over micro-batches
    assert out["density"] == pytest.approx((0.5 * 500 + 0.75 * 25) / 525)
    assert (rec.loss_sum, rec.weight) == (6.0, 4.0)
    empty = RankRecord.from_results(_decision(0), []).to_json()
    assert empty["budget_min"] == empty["budget_max"] == 0.95 and empty["density"] == 0.0
    both = StepFeedback.from_records([RankRecord.from_results(_decision(0), [b]), rec])
    assert both.microbatches == (b, a, b)  # rank order, then micro-batch order


def test_rank_record_says_which_unit_a_rank_ran_and_its_ring_wait():
    cp = MicroBatchResult(
        2.0,
        (12288,),
        (17,),
        ((0.5,),),
        (0.9,),
        3.0,
        2.0,
        slot=0,
        unit_ranks=(1, 2, 3),
        ring="flat",
        ring_wait_s=0.25,
        start_s=0.125,
    )
    dp = MicroBatchResult(0.5, (100, 200), (3, 4), ((1.0, 1.0),), (0.9,), 1.0, 1.0, slot=5, start_s=2.25)
    out = RankRecord.from_results(_decision(2), [cp, dp]).to_json()
    assert out["ring_wait_s"] == 0.25
    first, second = out["units"]
    assert first == {
        "slot": 0,
        "ranks": [1, 2, 3],
        "degree": 3,
        "ring": "flat",
        "sample_ids": [17],
        "tokens": 12288,
        "start_s": 0.125,
        "seconds": 2.0,
        "ring_wait_s": 0.25,
        "density": 0.5,
    }
    assert (second["slot"], second["degree"], second["ranks"], second["ring"]) == (5, 1, [], "none")
    assert json.loads(json.dumps(out)) == out  # a metrics.jsonl line


class _Recorder:
    def __init__(self):
        self.seen: list = []

    def observe(self, samples, densities, budgets=None):
        self.seen.append(([s.id for s in samples], list(densities), list(budgets)))

    def update(self, lengths, densities, seconds):
        self.seen.append(("latency", list(lengths), seconds))


def test_feedback_recovers_d0_per_document_and_skips_dense_layers():
    curve = DensityCurve(gamma0=0.9)
    d0 = np.array([0.3, 0.6])
    measured = tuple(tuple(curve.density(d0, g).tolist()) for g in (0.8, 0.95))
    informative = _mb([4, 7], [10, 20], (*measured, (1.0, 1.0)), [0.8, 0.95, 1.0])
    dense = _mb([9], [5], ((1.0,),), [1.0])
    est, lat = _Recorder(), _Recorder()
    sample = lambda i: Sample(i, 10)  # noqa: E731
    knob = DSTConfig(budget="gamma").knob(64, curve)
    apply_feedback(StepFeedback((informative, dense)), lat, est, knob, sample, use_timings=False)
    assert lat.seen == []  # --deterministic: no timing is fed back
    ((ids, dens, _),) = est.seen
    assert ids == [4, 7]  # sample 9 ran only at gamma 1: nothing to learn
    np.testing.assert_allclose(dens, d0, rtol=1e-9)
    apply_feedback(StepFeedback((dense,)), lat, est, knob, sample, use_timings=True)
    assert lat.seen == [("latency", [5], 0.5)]


def test_feedback_under_top_k_gives_realized_densities_and_final_budgets():
    """Top-k: a document's density is what its final k keeps (no inverse curve); the estimator
    also gets each document's k averaged over layers and over its chunks."""
    knob = DSTConfig(budget_tokens=512).knob(64)
    a = _mb([4, 7], [10, 20], ((0.5, 0.25), (0.3, 0.75)), [6, 10])
    b = _mb([7], [20], ((0.5,), (0.5,)), [4, 4])  # a second chunk of document 7
    est, lat = _Recorder(), _Recorder()
    apply_feedback(StepFeedback((a, b)), lat, est, knob, lambda i: Sample(i, 10), use_timings=False)
    ((ids, dens, budgets),) = est.seen
    assert ids == [4, 7]
    np.testing.assert_allclose(dens, [0.4, (0.5 + 0.5) / 2])
    np.testing.assert_allclose(budgets, [8.0, (8.0 + 4.0) / 2])


def test_cp_units_recalibrate_the_ring_terms_not_the_base_model():
    from sparsebalance.engine.feedback import unit_timings
    from tests.batching.fake_cost import FakeCost, fake_context

    def shard(rank, start, seconds, wait, slot=0):
        return MicroBatchResult(
            seconds,
            (8192,),
            (17,),
            ((0.5,), (0.7,)),
            (0.9, 0.9),
            1.0,
            1.0,
            slot=slot,
            unit_ranks=(1, 2, 3),
            ring="flat",
            ring_wait_s=wait,
            start_s=start,
        )

    # rank 3 arrives 0.5 s late; all end at 3.0: the unit took 2.5 s
    parts = (shard(1, 0.0, 3.0, 0.9), shard(2, 0.0, 3.0, 0.8), shard(3, 0.5, 2.5, 0.2))
    one = _mb([4], [300], ((0.5,), (0.5,)), [0.9, 0.9], seconds=0.125)
    (t,) = unit_timings((*parts, one))
    assert (t.length, t.degree, t.seconds) == (8192, 3, 2.5)
    assert t.density == pytest.approx(0.6) and t.rank_compute == (2.1, 2.2, 2.3)
    # without stamps: the last-arriving rank's seconds; without waits: no per-rank compute
    bare = tuple(replace(p, start_s=None, ring_wait_s=0.0) for p in parts)
    (u,) = unit_timings(bare)
    assert (u.seconds, u.rank_compute) == (2.5, ())
    assert unit_timings(parts[:2]) == []  # a unit missing a rank's record gives no timing

    base = _Recorder()
    ctx = fake_context(FakeCost(a=1e-5, b=1e-8), bandwidth=2e6)
    before = ctx.state_dict()
    knob = DSTConfig(budget="gamma").knob(64)
    apply_feedback(StepFeedback((*parts, one)), base, _Recorder(), knob, lambda i: Sample(i, 10), context=ctx)
    assert base.seen == [("latency", [300], 0.125)]  # only the one-rank micro-batch
    after = ctx.state_dict()
    assert after["counts"]["comm"] == 1 and after != before
    apply_feedback(
        StepFeedback(parts), base, _Recorder(), knob, lambda i: Sample(i, 10), use_timings=False, context=ctx
    )
    assert ctx.state_dict() == after  # --deterministic: no timing is fed back


def test_starts_become_seconds_into_the_step():
    mb = MicroBatchResult(0.5, (10,), (1,), ((1.0,),), (0.9,), 1.0, 1.0, slot=3, start_s=100.25)
    rec = RankRecord.from_results(_decision(0), [mb, replace(mb, slot=4, start_s=None)])
    rec.relative_to(100.0)
    assert [u["start_s"] for u in rec.units] == [0.25, None]
    assert rec.microbatches[0].start_s == 0.25
    rec.relative_to(None)  # emulated ranks: no schedule
    assert [u["start_s"] for u in rec.to_json()["units"]] == [None, None]
