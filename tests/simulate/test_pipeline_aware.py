"""``simulate --pp P``: SAB and DST run pipeline-aware (P reaches the planner, DST prices
makespans), and the pipeline-aware plan is priced no slower than the rank-total one."""

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig
from sparsebalance.batching.planner import assign_batch
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.simulate import engine, simulate_steps
from sparsebalance.simulate.pipeline import pipeline_record
from sparsebalance.tuning import DSTConfig, PipelineWorkload


@pytest.fixture(scope="module")
def model():
    return LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h200", block_size=128))


def _batch(seed, n=16):
    rng = np.random.default_rng(seed)
    return rng.integers(256, 16384, n), rng.uniform(0.1, 0.6, n)


def test_pp_reaches_the_planner_and_dst(model, monkeypatch):
    seen_plan, seen_work = [], []
    real_assign, real_decide = engine.assign_batch, engine.DSTTuner.decide_arrays

    def assign(lengths, dens, cost, cfg):
        seen_plan.append((cfg.strategy, cfg.pipeline_stages))
        return real_assign(lengths, dens, cost, cfg)

    def decide(self, work):
        seen_work.append(type(work))
        return real_decide(self, work)

    monkeypatch.setattr(engine, "assign_batch", assign)
    monkeypatch.setattr(engine.DSTTuner, "decide_arrays", decide)
    simulate_steps([_batch(0)], 2, model, micro_batches=4, block_size=128, strategies=["sab+dst"], pipeline_stages=4)
    assert ("sab", 4) in seen_plan and ("sequential", 4) in seen_plan
    assert set(seen_work) == {PipelineWorkload}


@pytest.mark.parametrize("seed", range(4))
def test_pipeline_sab_is_priced_no_slower_than_rank_total_sab(model, seed):
    lengths, d0 = _batch(seed, 24)
    knob = DSTConfig().knob(128, None)
    dens = knob.density(lengths, d0, float(knob.base))  # what the simulator's planner prices
    spans = {}
    for pp in (1, 4):
        a = assign_batch(lengths, dens, model, PlanConfig(3, 4, strategy="sab", pipeline_stages=pp))
        work = engine._workload(a, model, knob, d0, None)
        spans[pp] = pipeline_record(work, np.full(3, knob.base), 4)["compute"]
    assert spans[4] <= spans[1] * (1 + 1e-9)
