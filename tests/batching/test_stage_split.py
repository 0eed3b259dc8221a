"""The pipeline's layers per stage: the LM head's weight in layers (from the model's shapes), the
split balanced against it, and ``PlanConfig.stage_layers`` (the one split the planner prices)."""

import itertools

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig
from sparsebalance.batching.pipeline import PipelineShape, pack_makespans
from sparsebalance.batching.plan import padded_packs
from sparsebalance.batching.planner import assign_batch
from sparsebalance.batching.schedule import balanced_layers, head_layers, head_seconds, resolve_layers, stage_layers
from sparsebalance.models import load_shapes

from .fake_cost import FakeCost


def stage_cost(split, head: float) -> float:
    return max(*split[:-1], split[-1] + head) if len(split) > 1 else split[0] + head


def test_head_layers_of_the_shipped_models():
    # Qwen2.5-3B: H V = 2048 x 151936 over 2048 x 2048 x 2 (q, o) + 2 x 2048 x 256 (k, v) + 3 x 2048 x 11008
    assert head_layers(load_shapes("qwen2.5-3b")) == pytest.approx(311_164_928 / 77_070_336)
    assert 4.0 < head_layers(load_shapes("qwen2.5-3b")) < 4.1
    # tiny: 256 x 4096 over 3 x 256 x 256 + 2 x 256 x 128 ... = 1,048,576 / 786,432
    assert head_layers(load_shapes("tiny")) == pytest.approx(4 / 3)


def test_a_large_head_takes_layers_off_the_last_stage():
    h = head_layers(load_shapes("qwen2.5-3b"))
    split = balanced_layers(36, 4, h)
    assert split.tolist() == [10, 10, 10, 6]
    assert stage_cost(split.tolist(), h) < 13 and stage_cost(split.tolist(), h) == pytest.approx(6 + h)
    assert stage_cost(stage_layers(36, 4).tolist(), h) == pytest.approx(9 + h)  # the even split: ~13.04
    assert balanced_layers(4, 2, head_layers(load_shapes("tiny"))).tolist() == [3, 1]


@pytest.mark.parametrize("num_layers,num_stages", [(4, 2), (10, 4), (36, 4), (24, 3), (7, 7), (36, 8)])
@pytest.mark.parametrize("head", [0.0, 0.3, 0.99])
def test_a_head_under_one_layer_changes_nothing(num_layers, num_stages, head):
    assert balanced_layers(num_layers, num_stages, head).tolist() == stage_layers(num_layers, num_stages).tolist()


def test_one_stage_holds_every_layer():
    assert balanced_layers(36, 1, 4.0).tolist() == [36]
    assert balanced_layers(1, 1, 100.0).tolist() == [1]


@pytest.mark.parametrize("num_layers", [1, 2, 5, 9, 12])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("head", [0.0, 0.5, 1.0, 1.5, 2.7, 4.04, 30.0])
def test_the_split_is_the_best_of_every_split(num_layers, num_stages, head):
    """Against every contiguous split of >= 1 layer per stage: the least largest stage cost, and
    the tie rule (the even split, then more layers on the last stage)."""
    if num_stages > num_layers:
        with pytest.raises(ValueError, match="more pipeline stages"):
            balanced_layers(num_layers, num_stages, head)
        return
    got = balanced_layers(num_layers, num_stages, head).tolist()
    assert sum(got) == num_layers and min(got) >= 1 and len(got) == num_stages
    every = [
        [*c, num_layers - sum(c)]
        for c in itertools.product(range(1, num_layers + 1), repeat=num_stages - 1)
        if num_layers - sum(c) >= 1
    ]
    best = min(stage_cost(s, head) for s in every)
    assert stage_cost(got, head) == pytest.approx(best)
    even = stage_layers(num_layers, num_stages).tolist()
    if stage_cost(even, head) <= best + 1e-9:
        assert got == even
    else:
        assert got[-1] == max(s[-1] for s in every if stage_cost(s, head) <= best + 1e-9)


def test_bad_heads_and_splits_are_refused():
    with pytest.raises(ValueError, match="head_layers must be finite and >= 0"):
        balanced_layers(8, 2, -1.0)
    with pytest.raises(ValueError, match="head_layers must be finite"):
        balanced_layers(8, 2, float("nan"))
    assert resolve_layers(8, 2).tolist() == [4, 4]
    assert resolve_layers(8, 2, (5, 3)).tolist() == [5, 3]
    for bad in [(4, 3), (8, 0), (2, 3, 3)]:
        with pytest.raises(ValueError, match=r"need 2 stages of >= 1 layer summing to the model's 8 layers"):
            resolve_layers(8, 2, bad)


def test_plan_config_checks_the_split():
    assert PlanConfig(2, 4, pipeline_stages=2, stage_layers=(3, 1)).stage_layers == (3, 1)
    assert PlanConfig(2, 4).stage_layers == ()  # the even split
    with pytest.raises(ValueError, match=r"one entry >= 1 per pipeline stage \(--pp 2\)"):
        PlanConfig(2, 4, pipeline_stages=2, stage_layers=(2, 1, 1))
    with pytest.raises(ValueError, match=r"one entry >= 1 per pipeline stage"):
        PlanConfig(2, 4, pipeline_stages=2, stage_layers=(4, 0))
    with pytest.raises(ValueError, match="stage_layers must be a tuple of integers"):
        PlanConfig(2, 4, pipeline_stages=2, stage_layers=[3, 1])
    with pytest.raises(ValueError, match="summing to the model's 8 layers"):  # checked against the model
        assign_batch(np.array([100, 200, 300, 400]), np.full(4, 0.5), EightLayers(), _piped((3, 1, 1, 1)))


class EightLayers(FakeCost):
    num_layers = 8

    def __init__(self):
        super().__init__(a=1e-5, b=1e-7, c0=0.2)  # a head (c0) of ~2 layers on the last stage


def _piped(split=()):
    return PlanConfig(2, 4, strategy="sab", pipeline_stages=4, stage_layers=split)


def test_the_planner_prices_the_given_split():
    rng = np.random.default_rng(5)
    lengths, dens = rng.integers(64, 4000, 24), rng.uniform(0.2, 0.8, 24)
    cost = EightLayers()
    spans = {}
    for split in [(), (3, 2, 2, 1), (1, 2, 2, 3)]:
        a = assign_batch(lengths, dens, cost, _piped(split))
        lens, d = padded_packs(a.flat, a.items)
        head = head_seconds(cost, lens, d, a.times[0])
        shape = PipelineShape.of(8, 4, split)
        want = pack_makespans(a.times[0], a.flat.mb_rank, 2, shape, head).max()
        assert a.extra["makespan"] == pytest.approx(want, rel=1e-12)
        spans[split] = a.extra["makespan"]
    assert spans[(3, 2, 2, 1)] < spans[()] < spans[(1, 2, 2, 3)]  # the head's stage lighter: shorter
