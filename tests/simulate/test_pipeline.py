"""The simulator's 1F1B pipelines: hand-computed makespans, bounds, the stage split, ``--pp``."""

import json

import numpy as np
import pytest

from sparsebalance.batching.schedule import dependency_order, settled_sends
from sparsebalance.cli import main as cli_main
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.simulate import LengthDistribution, SimConfig, run_simulation, simulate_steps
from sparsebalance.simulate.pipeline import (
    one_f_one_b,
    schedule_order,
    split_forward_backward,
    stage_layers,
    stage_seconds,
)


@pytest.mark.parametrize("m", [1, 2, 4, 7])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)])
def test_equal_times_give_the_textbook_makespan(m, p, f, b):
    res = one_f_one_b(np.full((m, p), f), np.full((m, p), b))
    assert res.makespan == pytest.approx((m + p - 1) * (f + b))
    assert res.busy == pytest.approx(np.full(p, m * (f + b)))
    assert res.bubble == pytest.approx(np.full(p, (p - 1) * (f + b)))


def test_one_slow_micro_batch_by_hand():
    # P = 2, M = 2; micro-batch 0 takes f = 2, b = 4 on both stages, micro-batch 1 f = 1, b = 2.
    # stage 0: F0 [0,2] F1 [2,3] B0 [8,12] B1 [12,14]; stage 1: F0 [2,4] B0 [4,8] F1 [8,9] B1 [9,11]
    f = np.array([[2.0, 2.0], [1.0, 1.0]])
    res = one_f_one_b(f, 2 * f)
    assert res.makespan == 14.0
    assert res.busy.tolist() == [9.0, 9.0]
    assert res.bubble.tolist() == [5.0, 5.0]
    # the same work evenly spread (1.5 / 3 each) gives the textbook (M + P - 1) (f + b) = 13.5
    assert one_f_one_b(np.full((2, 2), 1.5), np.full((2, 2), 3.0)).makespan == 13.5


def test_one_stage_is_the_sum():
    rng = np.random.default_rng(0)
    f, b = rng.uniform(0.1, 2.0, (5, 1)), rng.uniform(0.1, 2.0, (5, 1))
    res = one_f_one_b(f, b)
    assert res.makespan == pytest.approx(f.sum() + b.sum())
    assert res.bubble == pytest.approx([0.0])


@pytest.mark.parametrize("seed", range(20))
def test_makespan_bounds(seed):
    rng = np.random.default_rng(seed)
    m, p = rng.integers(1, 9), rng.integers(1, 6)
    f = rng.uniform(0.0, 3.0, (m, p)) * (rng.random((m, p)) < 0.9)
    b = rng.uniform(0.0, 6.0, (m, p))
    res = one_f_one_b(f, b)
    assert res.makespan >= (f + b).sum(axis=0).max() - 1e-12  # no stage does two ops at once
    assert res.makespan >= (f + b).sum(axis=1).max() - 1e-12  # each micro-batch's critical path
    assert res.makespan <= (f + b).sum() + 1e-12  # never slower than running everything in series
    assert (res.bubble >= -1e-12).all()
    assert res.busy + res.bubble == pytest.approx(np.full(p, res.makespan))


def test_schedule_order_is_1f1b():
    assert schedule_order(4, 4, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)]
    assert schedule_order(4, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert schedule_order(4, 4, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert schedule_order(4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # warm-up capped at M


def _ancestors(p: int, m: int) -> dict[tuple[str, int, int], set]:
    """Every op ``(kind, micro-batch, stage)``'s ancestors: the previous op of its stage, and its
    input (the forward on the stage before; the backward on the stage after, or on the last stage
    its own forward), transitively."""
    parents: dict = {}
    for s in range(p):
        order = schedule_order(p, m, s)
        for i, (kind, mb) in enumerate(order):
            deps = [(*order[i - 1], s)] if i else []
            if kind == "F" and s > 0:
                deps.append(("F", mb, s - 1))
            elif kind == "B":
                deps.append(("B", mb, s + 1) if s < p - 1 else ("F", mb, s))
            parents[(kind, mb, s)] = deps
    found: dict = {}
    for op in dependency_order(p, m):  # parents first
        found[op] = set().union(*({d} | found[d] for d in parents[op])) if parents[op] else set()
    return found


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_a_stage_keeps_only_the_sends_in_flight(p, m):
    """A receive settles only sends its peer received before sending it (the peer's receive is an
    ancestor of the receiving op in the schedule's dependency graph: every order runs it first);
    every send is settled or still pending at the end; no stage holds more than P sends at once,
    however many micro-batches."""
    before = _ancestors(p, m)
    for s in range(p):
        settled, pending, most = settled_sends(p, m, s), set(), 0
        for kind, mb in schedule_order(p, m, s):
            for k in settled.get((kind, mb), []):
                peer = s + 1 if k[0] == "F" else s - 1
                assert (*k, peer) in before[(kind, mb, s)]
                pending.remove(k)
            if (kind == "F" and s < p - 1) or (kind == "B" and s > 0):
                pending.add((kind, mb))
            most = max(most, len(pending))
        assert most <= p
        sends = m * ((s < p - 1) + (s > 0))
        assert sum(len(v) for v in settled.values()) + len(pending) == sends
    if m == 8:  # the first stage settles its first activations when their gradient comes back
        assert ("F", 0) in settled_sends(p, m, 0)[("B", 0)]


def test_bad_inputs_refused():
    with pytest.raises(ValueError, match=r"\(M, P\)"):
        one_f_one_b(np.ones((2, 2)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="finite"):
        one_f_one_b(np.full((1, 1), np.nan), np.ones((1, 1)))
    with pytest.raises(ValueError, match="more pipeline stages than the model's 4 layers"):
        stage_layers(4, 5)
    with pytest.raises(ValueError, match="--pp must be an integer >= 1"):
        stage_layers(4, 0)


def test_stage_split_sums_to_the_prediction():
    assert stage_layers(36, 4).tolist() == [9, 9, 9, 9]
    assert stage_layers(10, 4).tolist() == [3, 3, 2, 2]  # the head's stage gets fewer layers
    model = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h200", block_size=128))
    lengths = np.array([[4096, 1024], [8192, 0]])
    dens = np.array([[0.3, 0.5], [0.2, 1.0]])
    st = stage_seconds(model, lengths, dens, 4)
    assert st.shape == (2, 4)
    assert st.sum(axis=1) == pytest.approx(model.predict_many(lengths, dens), rel=1e-12)
    layers = stage_layers(model.num_layers, 4)
    per_layer = st[:, 0] / layers[0]
    assert st[:, 1] == pytest.approx(per_layer * layers[1])
    assert (st[:, -1] > per_layer * layers[-1]).all()  # the LM head is on the last stage
    fw, bw = split_forward_backward(st)
    assert bw == pytest.approx(2.0 * fw)
    assert fw + bw == pytest.approx(st)


SMALL = dict(world_sizes=(2,), micro_batches=4, steps=2, samples_per_rank=8, model="qwen2.5-0.5b")


def _config(**kw):
    return SimConfig(lengths=LengthDistribution("heavy", 256, 16384), **{**SMALL, **kw})


def test_pp1_is_today():
    a = run_simulation(_config())
    b = run_simulation(_config(pipeline_stages=1))
    assert a["results"][0]["strategies"] == b["results"][0]["strategies"]
    assert "pipeline_stages" not in a
    assert "device_idle_fraction" not in a["results"][0]["strategies"]["sab"]


def test_one_stage_pipelines_are_the_rank_sums():
    # the pipeline model at P = 1 prices exactly what --pp 1 (rank totals) prices
    from sparsebalance.batching import PlanConfig
    from sparsebalance.batching.planner import assign_batch
    from sparsebalance.simulate.engine import _workload
    from sparsebalance.simulate.pipeline import pipeline_record
    from sparsebalance.tuning import DSTConfig

    model = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h200", block_size=128))
    rng = np.random.default_rng(2)
    lengths, d0 = rng.integers(256, 16384, 24), rng.uniform(0.1, 0.6, 24)
    knob = DSTConfig().knob(128, None)
    a = assign_batch(lengths, d0, model, PlanConfig(3, 4, None, "sab"))
    work = _workload(a, model, knob, d0, None)
    values = np.array([knob.base, knob.base / 2, knob.base * 2])
    rec = pipeline_record(work, values, 1)
    assert rec["rank_times"] == pytest.approx(work.seconds(values), rel=1e-12)
    assert rec["device_idle"] == pytest.approx(1 - work.seconds(values).mean() / work.seconds(values).max())


def test_pp_step_is_the_slowest_pipeline():
    model = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h200", block_size=128))
    rng = np.random.default_rng(1)
    lengths = rng.integers(256, 16384, 16)
    batch = (lengths, np.full(16, 0.3))
    kw = dict(micro_batches=4, block_size=128, strategies=["sab"])
    flat = simulate_steps([batch], 2, model, **kw)
    pipe = simulate_steps([batch], 2, model, pipeline_stages=4, **kw)
    for name in ("baseline", "sab"):
        s, f = pipe["strategies"][name], flat["strategies"][name]
        times = np.array(pipe["rank_times"][name])
        assert s["compute_seconds"] == pytest.approx(times.max())
        # 4 stages share the work: faster than one device, never better than a perfect 4x
        assert f["compute_seconds"] / 4 < s["compute_seconds"] < f["compute_seconds"]
        assert 0.0 < s["device_idle_fraction"] < 1.0
        assert s["microbatch_imbalance"] >= 1.0


def test_cli_pp(capsys):
    args = ["simulate", "--world-size", "2", "--micro-batches", "4", "--steps", "2", "--pp", "4", "--json"]
    assert cli_main([*args, "--strategy", "sab"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pipeline_stages"] == 4
    assert "device_idle_fraction" in out["results"][0]["strategies"]["sab"]
    base = ["simulate", "--world-size", "2", "--micro-batches", "4"]
    assert cli_main([*base, "--pp", "0"]) == 2
    assert "--pp must be >= 1" in capsys.readouterr().err
    assert cli_main([*base, "--pp", "25"]) == 2  # qwen2.5-0.5b has 24 layers
    assert "more pipeline stages than the model's 24 layers" in capsys.readouterr().err


def test_the_simulator_prices_the_given_split():
    """``stage_layers``: the stage times, the planner, DST and the step's makespan all use it;
    the simulate command splits as the trainer does (``balanced_layers`` from the shapes)."""
    from sparsebalance.batching.schedule import balanced_layers, head_layers
    from sparsebalance.simulate.pipeline import stage_seconds

    shapes = load_shapes("qwen2.5-0.5b")  # 24 layers, a head of ~9 layers
    model = LatencyModel(analytic_profile(shapes, "h200", block_size=128))
    split = tuple(balanced_layers(24, 4, head_layers(shapes)).tolist())
    assert split == (8, 8, 7, 1)
    st = stage_seconds(model, np.array([[4096, 1024]]), np.array([[0.3, 0.5]]), 4, split)
    assert st[0, 2] == pytest.approx(st[0, 0] * 7 / 8)  # 7 layers against 8
    rng = np.random.default_rng(1)
    batch = (rng.integers(256, 16384, 16), np.full(16, 0.3))
    kw = dict(micro_batches=4, block_size=128, strategies=["sab", "sab+dst"], pipeline_stages=4)
    even = simulate_steps([batch], 2, model, **kw)
    balanced = simulate_steps([batch], 2, model, stage_layers=split, **kw)
    for name in ("baseline", "sab", "sab+dst"):  # the head's stage was the bottleneck
        assert balanced["strategies"][name]["compute_seconds"] < even["strategies"][name]["compute_seconds"]
    with pytest.raises(ValueError, match="summing to the model's 24 layers"):
        simulate_steps([batch], 2, model, stage_layers=(6, 6, 6, 5), **kw)
    with pytest.raises(ValueError, match="given without a pipeline"):
        simulate_steps([batch], 2, model, micro_batches=4, block_size=128, stage_layers=(24,))
    res = run_simulation(_config(pipeline_stages=4))
    assert res["stage_layers"] == list(split)
