"""ZB-H1 in the simulator (``pipeline_schedule="zb-h1"``, ``simulate --pp-schedule zb-h1``): the
planner, DST and the step's pricing all read ZB-H1's makespan, a device's busy time is its F + B +
W seconds, and the refusals."""

import json

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig
from sparsebalance.batching import zero_bubble as zb
from sparsebalance.batching.planner import assign_batch
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.simulate import SimConfig, engine, simulate_steps
from sparsebalance.simulate.engine import _workload
from sparsebalance.simulate.pipeline import pipeline_record, pipeline_result, split_forward_backward
from sparsebalance.tuning import DSTConfig, PipelineWorkload


@pytest.fixture(scope="module")
def model():
    return LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h200", block_size=128))


def _batch(seed: int, n: int = 16):
    rng = np.random.default_rng(seed)
    return rng.integers(256, 16384, n), rng.uniform(0.1, 0.6, n)


def test_pipeline_result_is_zb_h1s_and_busy_plus_idle_is_the_makespan():
    rng = np.random.default_rng(0)
    st = rng.uniform(0.1, 1.0, (5, 4))  # M = 5, P = 4
    f, b = split_forward_backward(st)
    res = pipeline_result(f, b, weight_share=0.4)
    b_in, b_w = 0.6 * b, 0.4 * b
    assert res.makespan == pytest.approx(zb.makespans(f[None], b_in[None], b_w[None])[0], rel=1e-12)
    assert res.busy == pytest.approx((f + b_in + b_w).sum(axis=0))  # the same work as 1F1B's
    assert res.busy + res.bubble == pytest.approx(np.full(4, res.makespan))
    assert res.makespan < pipeline_result(f, b).makespan
    with pytest.raises(ValueError, match="one chunk per device"):
        pipeline_result(np.ones((2, 4)), np.ones((2, 4)), virtual=2, weight_share=0.3)


def test_dst_and_the_simulator_price_the_same_zb_h1_makespans(model):
    lengths, d0 = _batch(2, 24)
    knob = DSTConfig().knob(128, None)
    cfg = PlanConfig(3, 4, None, "sab", pipeline_stages=4, pipeline_schedule="zb-h1")
    a = assign_batch(lengths, d0, model, cfg)
    work = _workload(a, model, knob, d0, None)
    values = np.array([knob.base, knob.base / 2, knob.base * 2])
    rec = pipeline_record(work, values, 4, weight_share=zb.WEIGHT_SHARE)
    pipe = PipelineWorkload(work, cfg.pipeline(model.num_layers))
    assert pipe.seconds(values) == pytest.approx(rec["rank_times"], rel=1e-9)
    plain = pipeline_record(work, values, 4)
    assert (rec["rank_times"] < plain["rank_times"]).all()  # the same micro-batches, smaller bubbles
    # device idle from the stage times: busy = F + B + W = the micro-batches' seconds per stage
    busy = np.stack([st.sum(axis=0) for st in rec["stage_times"]])
    assert rec["device_idle"] == pytest.approx(1.0 - busy.mean() / rec["compute"], rel=1e-12)
    for st, span in zip(rec["stage_times"], rec["rank_times"], strict=True):
        assert pipeline_result(*split_forward_backward(st), weight_share=zb.WEIGHT_SHARE).makespan == pytest.approx(
            span, rel=1e-12
        )


def test_zb_h1_reaches_the_planner_and_dst(model, monkeypatch):
    seen_plan, seen_work = [], []
    real_assign, real_decide = engine.assign_batch, engine.DSTTuner.decide_arrays

    def assign(lengths, dens, cost, cfg):
        seen_plan.append((cfg.strategy, cfg.pipeline_schedule, cfg.weight_share))
        return real_assign(lengths, dens, cost, cfg)

    def decide(self, work):
        seen_work.append(work.shape.weight_share)
        return real_decide(self, work)

    monkeypatch.setattr(engine, "assign_batch", assign)
    monkeypatch.setattr(engine.DSTTuner, "decide_arrays", decide)
    kw = dict(micro_batches=4, block_size=128, strategies=["sab+dst"], pipeline_stages=4)
    simulate_steps([_batch(0)], 2, model, pipeline_schedule="zb-h1", weight_share=0.45, **kw)
    assert set(seen_plan) == {("sab", "zb-h1", 0.45), ("sequential", "zb-h1", 0.45)}
    assert set(seen_work) == {0.45}


def test_zb_h1_steps_are_shorter_than_1f1b_at_pp4(model):
    batches = [_batch(s) for s in range(3)]
    kw = dict(micro_batches=4, block_size=128, strategies=["sab", "sab+dst"], pipeline_stages=4)
    one = simulate_steps(batches, 2, model, **kw)
    for share in (1 / 3, 0.5):
        zero = simulate_steps(batches, 2, model, pipeline_schedule="zb-h1", weight_share=share, **kw)
        for name in ("baseline", "sab", "sab+dst"):
            assert zero["strategies"][name]["step_seconds"] < one["strategies"][name]["step_seconds"]
            assert zero["strategies"][name]["device_idle_fraction"] < one["strategies"][name]["device_idle_fraction"]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(pipeline_schedule="zb-h1"), r"zb-h1 needs a pipeline \(--pp >= 2\), got --pp 1"),
        (dict(pipeline_stages=4, pipeline_virtual=2, pipeline_schedule="zb-h1"), "cannot run with --pp-virtual 2"),
        (dict(pipeline_stages=4, pipeline_schedule="ZB-H1"), "--pp-schedule must be one of 1f1b, zb-h1"),
        (dict(pipeline_stages=4, pipeline_schedule="zb-h1", weight_share=1.5), r"\[0, 1\), got 1.5"),
    ],
    ids=["no-pipeline", "interleaved", "unknown", "share"],
)
def test_simulate_steps_refuses_in_one_line(model, kw, match):
    with pytest.raises(ValueError, match=match) as err:
        simulate_steps([_batch(0)], 2, model, micro_batches=4, block_size=128, **kw)
    assert "\n" not in str(err.value)


def test_sim_config_refuses_like_pp_virtual():
    with pytest.raises(ValueError, match="zb-h1 needs a pipeline"):
        SimConfig(pipeline_schedule="zb-h1")
    with pytest.raises(ValueError, match="cannot run with --pp-virtual 2"):
        SimConfig(pipeline_stages=2, pipeline_virtual=2, pipeline_schedule="zb-h1")
    with pytest.raises(ValueError, match="--pp-schedule must be one of"):
        SimConfig(pipeline_stages=2, pipeline_schedule="zero")
    with pytest.raises(ValueError, match=r"--pp-weight-share .* \[0, 1\)"):
        SimConfig(pipeline_stages=2, pipeline_schedule="zb-h1", pipeline_weight_share=1.0)


def test_cli_pp_schedule(capsys):
    from sparsebalance.cli import main as cli_main

    args = ["simulate", "--world-size", "2", "--micro-batches", "4", "--steps", "2", "--strategy", "sab", "--pp", "2"]
    assert cli_main([*args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main([*args, "--pp-schedule", "zb-h1", "--pp-weight-share", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pipeline_schedule"] == "zb-h1" and out["weight_share"] == 0.5
    assert "pipeline_schedule" not in plain
    idle = [o["results"][0]["strategies"]["baseline"]["device_idle_fraction"] for o in (plain, out)]
    assert idle[1] < idle[0]
    assert cli_main([*args, "--pp-schedule", "zb-h1"]) == 0
    assert "a zero-bubble ZB-H1 pipeline of 2 stages" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main([*args, "--pp-schedule", "zb"])
    assert "invalid choice" in capsys.readouterr().err
