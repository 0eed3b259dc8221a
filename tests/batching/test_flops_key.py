"""The ``flops`` baseline balances ``c L + L^2``, ``c`` from the model's shapes (verl, slime)."""

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.batching.strategies import fit_linear_coef, flops_linear_coef
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.workload import Sample

LLAMA_7B = {
    "num_layers": 32,
    "hidden_size": 4096,
    "num_heads": 32,
    "num_kv_heads": 32,
    "head_dim": 128,
    "intermediate_size": 11008,
    "vocab_size": 32000,
}


def test_llama_7b_coefficient_is_about_verls():
    c = flops_linear_coef(LLAMA_7B)
    assert c == pytest.approx(24576, rel=0.03)  # verl: 6 x hidden
    # by hand: (4 h^2 + 3 h i + h V / layers) / (2 h)
    h, i = 4096, 11008
    assert c == pytest.approx((4 * h * h + 3 * h * i + h * 32000 / 32) / (2 * h))


def test_gqa_and_shapes_of_a_builtin_model():
    shapes = load_shapes("qwen2.5-0.5b").to_dict()
    h, d = 896, 64
    want = (h * d * (2 * 14 + 2 * 2) + 3 * h * 4864 + h * 151936 / 24) / (2 * 14 * d)
    assert flops_linear_coef(shapes) == pytest.approx(want)


def _key_order(plan) -> list[list[tuple[int, ...]]]:
    return [sorted(tuple(sorted(mb.sample_ids)) for mb in rank) for rank in plan.ranks]


def test_flops_plans_differ_from_tokens_under_the_default_cost_model():
    model = LatencyModel(analytic_profile(load_shapes("tiny"), block_size=128))
    # the old key: fitted to this cost model, it degenerates to plain L
    assert fit_linear_coef(lambda n: model.doc_seconds(n, np.ones_like(n))) == np.inf
    c = flops_linear_coef(load_shapes("tiny").to_dict())
    assert 0 < c < np.inf
    # one long document against shorter ones: tokens put 3,000 + 1,500 together, FLOPs
    # (c L + L^2: the long one costs more than its share of tokens) keep it alone
    samples = [Sample(i, n) for i, n in enumerate([3000, 2000, 1500, 1500])]
    dens = np.full(4, 0.3)
    plans = {
        s: plan_batch(samples, model, PlanConfig(2, micro_batches=2, strategy=s), dens) for s in ("tokens", "flops")
    }
    assert _key_order(plans["tokens"]) != _key_order(plans["flops"])
    flops_ranks = sorted(sorted(i for mb in r for i in mb.sample_ids) for r in plans["flops"].ranks)
    assert flops_ranks == [[0], [1, 2, 3]]
    # an explicit coefficient still wins; inf reproduces the tokens plan
    same = PlanConfig(2, micro_batches=2, strategy="flops", flops_linear_coef=np.inf)
    assert _key_order(plan_batch(samples, model, same, dens)) == _key_order(plans["tokens"])


def test_equal_lengths_plan_alike():
    # where lengths are equal the key cannot tell documents apart: same plan as tokens
    model = LatencyModel(analytic_profile(load_shapes("tiny"), block_size=128))
    samples = [Sample(i, 1024) for i in range(8)]
    dens = np.full(8, 0.5)
    a, b = (plan_batch(samples, model, PlanConfig(4, micro_batches=2, strategy=s), dens) for s in ("tokens", "flops"))
    assert _key_order(a) == _key_order(b)
