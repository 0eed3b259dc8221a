"""Interleaved 1F1B in the simulator (``pipeline_virtual``): the step prices the interleaved
makespan and DST reads the same one (ZB-H1: ``test_zero_bubble_sim.py``)."""

import json

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig
from sparsebalance.batching.planner import assign_batch
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.simulate import simulate_steps
from sparsebalance.simulate.engine import _workload
from sparsebalance.simulate.pipeline import pipeline_record, pipeline_result, split_forward_backward
from sparsebalance.tuning import DSTConfig, PipelineWorkload


def _model():
    return LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h200", block_size=128))


def _batch(seed: int, n: int = 16):
    rng = np.random.default_rng(seed)
    return rng.integers(256, 16384, n), rng.uniform(0.1, 0.6, n)


def test_dst_and_the_simulator_price_the_same_interleaved_makespans():
    model = _model()  # 24 layers
    lengths, d0 = _batch(2, 24)
    knob = DSTConfig().knob(128, None)
    cfg = PlanConfig(3, 4, None, "sab", pipeline_stages=4, pipeline_virtual=2)
    a = assign_batch(lengths, d0, model, cfg)
    work = _workload(a, model, knob, d0, None)
    values = np.array([knob.base, knob.base / 2, knob.base * 2])
    rec = pipeline_record(work, values, 4, virtual=2)
    pipe = PipelineWorkload(work, cfg.pipeline(model.num_layers))
    assert pipe.seconds(values) == pytest.approx(rec["rank_times"], rel=1e-9)
    plain = pipeline_record(work, values, 4)
    assert (rec["rank_times"] < plain["rank_times"]).all()  # the same micro-batches, shorter bubbles
    assert rec["device_idle"] < plain["device_idle"]
    assert all(st.shape[1] == 8 for st in rec["stage_times"])  # per virtual stage


def test_pipeline_result_sums_a_devices_chunks():
    rng = np.random.default_rng(0)
    st = rng.uniform(0.1, 1.0, (4, 6))  # M = 4, P = 3, V = 2
    res = pipeline_result(*split_forward_backward(st), virtual=2)
    assert res.busy == pytest.approx(st[:, :3].sum(axis=0) + st[:, 3:].sum(axis=0))
    assert res.busy + res.bubble == pytest.approx(np.full(3, res.makespan))


def test_interleaving_idles_less_in_the_simulated_step():
    model = _model()
    batches = [_batch(s) for s in range(3)]
    kw = dict(micro_batches=4, block_size=128, strategies=["sab+dst"], pipeline_stages=4)
    one = simulate_steps(batches, 2, model, **kw)
    two = simulate_steps(batches, 2, model, pipeline_virtual=2, **kw)
    for name in ("baseline", "sab+dst"):
        assert two["strategies"][name]["device_idle_fraction"] < one["strategies"][name]["device_idle_fraction"]
        assert two["strategies"][name]["step_seconds"] < one["strategies"][name]["step_seconds"]
    with pytest.raises(ValueError, match=r"--pp-virtual 2 needs a pipeline"):
        simulate_steps(batches, 2, model, micro_batches=4, block_size=128, pipeline_virtual=2)
    with pytest.raises(ValueError, match="stage_times: only pipelines"):
        simulate_steps(batches, 2, model, micro_batches=4, block_size=128, stage_times=True)


def test_cli_pp_virtual(capsys):
    from sparsebalance.cli import main as cli_main

    args = ["simulate", "--world-size", "2", "--micro-batches", "4", "--steps", "2", "--strategy", "sab"]
    assert cli_main([*args, "--pp", "2", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main([*args, "--pp", "2", "--pp-virtual", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pipeline_virtual"] == 2 and len(out["stage_layers"]) == 4  # per virtual stage
    idle = [o["results"][0]["strategies"]["baseline"]["device_idle_fraction"] for o in (plain, out)]
    assert idle[1] < idle[0]
    assert cli_main([*args, "--pp-virtual", "2"]) == 2
    err = capsys.readouterr().err
    assert "--pp-virtual 2 needs a pipeline (--pp >= 2), got --pp 1" in err
    assert cli_main([*args, "--pp", "4", "--pp-virtual", "7"]) == 2  # qwen2.5-0.5b has 24 layers
    assert "28 virtual stages, more than the model's 24 layers" in capsys.readouterr().err
