"""Padded micro-batches (``PlanConfig.pad_micro_batches``, ``simulate --pad-micro-batches``): every
document of a micro-batch is priced as its longest one, in the planner and in the simulator, and
``sab`` then never plans slower than the paper's LBB."""

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig
from sparsebalance.batching.pipeline import pack_makespans
from sparsebalance.batching.plan import Items, flatten_packs, longest_in_rows, padded_packs, predict_packs
from sparsebalance.batching.planner import assign_batch
from sparsebalance.batching.schedule import head_seconds
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.ops.budget import topk_density
from sparsebalance.simulate import SimConfig, simulate_steps

from .fake_cost import FakeCost


def _items(tokens, density, padded=True):
    tokens = np.asarray(tokens, dtype=np.int64)
    n = tokens.size
    z = np.zeros(n, dtype=np.int64)
    return Items(np.arange(n), z, tokens, np.asarray(density, dtype=np.float64), np.zeros(n), padded=padded)


def test_longest_in_rows_takes_the_first_of_ties():
    values = np.array([3, 7, 7, 1, 5, 5, 2])
    sizes = np.array([3, 1, 3])
    assert longest_in_rows(values, sizes).tolist() == [1, 3, 4]


def test_a_padded_micro_batch_prices_every_document_as_its_longest():
    items = _items([100, 900, 300, 50, 60], [1.0, 0.4, 0.8, 1.0, 0.9])
    flat = flatten_packs([[[0, 1, 2]], [[3, 4]]])
    lengths, dens = padded_packs(flat, items)
    assert lengths.tolist() == [[900, 900, 900], [60, 60, 0]]
    assert dens.tolist() == [[0.4, 0.4, 0.4], [0.9, 0.9, 1.0]]
    cost = FakeCost()
    times, _ = predict_packs(flat, items, cost)
    expect = [cost.c0 + 3 * cost.doc_seconds(900, 0.4), cost.c0 + 2 * cost.doc_seconds(60, 0.9)]
    assert np.allclose(times, expect, rtol=1e-12)
    # unpadded: each document at its own length
    plain, _ = predict_packs(flat, _items([100, 900, 300, 50, 60], [1.0, 0.4, 0.8, 1.0, 0.9], padded=False), cost)
    assert np.all(plain < times)


def test_padding_needs_counted_micro_batches_and_whole_documents(model):
    with pytest.raises(ValueError, match="--pad-micro-batches needs --micro-batches M, not --capacity"):
        PlanConfig(2, capacity=4096, pad_micro_batches=True)
    with pytest.raises(ValueError, match=r"context-parallel plans \(sab-cp\) are not padded"):
        PlanConfig(2, 2, strategy="sab-cp", pad_micro_batches=True)
    with pytest.raises(ValueError, match=r"context-parallel plans \(sab-cp\) are not padded"):
        simulate_steps(
            [_batch(0)], 2, model, micro_batches=4, block_size=128, strategies=["sab-cp"], pad_micro_batches=True
        )


def test_simconfig_refuses_padding_with_a_capacity():
    with pytest.raises(ValueError, match="--pad-micro-batches needs --micro-batches"):
        SimConfig(capacity=4096, micro_batches=None, pad_micro_batches=True)


@pytest.fixture(scope="module")
def model():
    return LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h200", block_size=128))


def _batch(seed, n=16):
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.25
    lengths = np.where(long, rng.integers(8192, 24000, n), rng.integers(512, 4096, n))
    return lengths, topk_density(lengths, 32, 128)


def _makespan(a, model, config):
    shape = config.pipeline(model.num_layers)
    lengths, dens = padded_packs(a.flat, a.items)
    head = head_seconds(model, lengths, dens, a.times[0])
    return float(pack_makespans(a.times[0], a.flat.mb_rank, a.flat.num_ranks, shape, head).max())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pp", [1, 4])
def test_padded_sab_is_never_predicted_slower_than_lbb(model, seed, pp):
    lengths, dens = _batch(seed)

    def plan(strategy):
        cfg = PlanConfig(2, 4, strategy=strategy, pipeline_stages=pp, pad_micro_batches=True)
        return cfg, assign_batch(lengths, dens, model, cfg)

    (cfg_s, sab), (cfg_l, lbb) = plan("sab"), plan("lbb")
    assert sab.items.padded and lbb.items.padded
    if pp == 1:
        assert sab.times[1].max() <= lbb.times[1].max() * (1 + 1e-12)
    else:
        assert _makespan(sab, model, cfg_s) <= _makespan(lbb, model, cfg_l) * (1 + 1e-12)


def test_without_padding_each_document_is_priced_at_its_own_length(model):
    lengths, dens = _batch(0)
    a = assign_batch(lengths, dens, model, PlanConfig(2, 4, pipeline_stages=4))
    assert not a.items.padded and a.extra["candidate"] in ("pipeline", "cost", "tokens")
    for mb, t in zip([mb for rank in a.packs for mb in rank if mb], a.times[0].tolist(), strict=True):
        own = a.items.tokens[mb][None, :], a.items.density[mb][None, :]
        assert t == pytest.approx(float(model.predict_many(*own)[0]), rel=1e-12)


@pytest.mark.parametrize("budget", ["top-k", "gamma"])
@pytest.mark.parametrize("pp", [1, 4])
@pytest.mark.parametrize("strategy", ["sequential", "sab", "lbb"])
def test_the_simulator_prices_a_padded_plan_as_the_planner_does(model, budget, pp, strategy):
    """With DST off, every rank's simulated time (pp 4: its makespan) is the planner's
    prediction for the same padded plan, under either budget kind."""
    from sparsebalance.simulate.engine import _Job  # the densities the simulator plans with
    from sparsebalance.tuning import DSTConfig

    lengths, content = _batch(3)
    dst = DSTConfig(budget=budget, budget_tokens=4096) if budget == "top-k" else DSTConfig(budget="gamma")
    res = simulate_steps(
        [(lengths, content)],
        2,
        model,
        micro_batches=4,
        block_size=128,
        strategies=[strategy],
        dst=dst,
        pipeline_stages=pp,
        pad_micro_batches=True,
    )
    name = {"sequential": "baseline"}.get(strategy, strategy)
    knob = dst.knob(128, None)
    job = _Job(2, model, 4, None, (), dst, knob)
    dens = job.planner_densities(type("B", (), {"lengths": lengths, "densities": content})())
    cfg = PlanConfig(2, 4, strategy=strategy, pipeline_stages=pp, pad_micro_batches=True)
    a = assign_batch(lengths, dens, model, cfg)
    if pp == 1:
        planned = a.times[1]
    else:
        shape = cfg.pipeline(model.num_layers)
        padded_lengths, padded_dens = padded_packs(a.flat, a.items)
        head = head_seconds(model, padded_lengths, padded_dens, a.times[0])
        planned = pack_makespans(a.times[0], a.flat.mb_rank, a.flat.num_ranks, shape, head)
    assert np.allclose(res["rank_times"][name], planned, rtol=1e-9)


def test_the_simulator_runs_every_document_at_its_micro_batch_longest(model):
    """One rank, one micro-batch of a long and a short document: the baseline's step is the
    micro-batch at (S, S), each at the base budget's density of S, and more than packed."""
    lengths = np.array([20000, 1000])
    content = np.array([0.3, 0.3])
    kw = dict(micro_batches=1, block_size=128, strategies=["baseline"])
    padded = simulate_steps([(lengths, content)], 1, model, pad_micro_batches=True, **kw)
    packed = simulate_steps([(lengths, content)], 1, model, **kw)
    d = topk_density(np.array([20000, 20000]), 8192 // 128, 128)
    expect = float(model.predict_many(np.array([[20000, 20000]]), d[None, :])[0])
    got = padded["strategies"]["baseline"]["compute_seconds"]
    assert got == pytest.approx(expect, rel=1e-9)
    assert got > 1.5 * packed["strategies"]["baseline"]["compute_seconds"]


def test_padded_simulation_keeps_the_pipeline_targets(model):
    """With padding and pipelines, LBB beats the dataset-order baseline on a bimodal mix (the
    padding it saves), and sab+dst beats lbb+dst."""
    batches = [_batch(s, 16) for s in range(4)]
    res = simulate_steps(
        batches,
        2,
        model,
        micro_batches=4,
        block_size=128,
        strategies=["lbb", "lbb+dst", "sab+dst"],
        pipeline_stages=4,
        pad_micro_batches=True,
    )["strategies"]
    assert res["lbb"]["speedup"] > 1.0
    assert res["sab+dst"]["speedup"] > res["lbb+dst"]["speedup"] > res["lbb"]["speedup"]
