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


@pytest.mark.parametrize(
    "kwargs",
    [{"capacity": 4096}, {"micro_batches": 2, "strategy": "sab-cp"}],
    ids=["capacity", "sab-cp"],
)
def test_padding_needs_counted_micro_batches_and_whole_documents(kwargs):
    with pytest.raises(ValueError, match="--pad-micro-batches needs --micro-batches"):
        PlanConfig(2, pad_micro_batches=True, **kwargs)


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


def test_without_padding_nothing_changes(model):
    lengths, dens = _batch(0)
    a = assign_batch(lengths, dens, model, PlanConfig(2, 4, pipeline_stages=4))
    b = assign_batch(lengths, dens, model, PlanConfig(2, 4, pipeline_stages=4, pad_micro_batches=False))
    assert not a.items.padded
    assert a.packs == b.packs and a.extra["candidate"] in ("pipeline", "cost", "tokens")


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
