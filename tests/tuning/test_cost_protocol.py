"""A cost model written from the ``CostModel`` protocol alone (docs/architecture.md's example:
no ``prepare``) is tuned; ``prepare`` is an optional capability (``PreparableCost``)."""

from __future__ import annotations

import numpy as np

from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.tuning import DSTConfig, DSTTuner
from sparsebalance.workload import MicroBatch, PreparableCost


class QuadraticCost:
    """Attention ~ density x length^2, the rest ~ tokens; nothing but the protocol's methods."""

    num_layers = 2

    def layer_attention_seconds(self, lengths, densities):
        return 1e-9 * np.asarray(densities, float) * np.asarray(lengths, float) ** 2

    def layer_other_seconds(self, num_tokens):
        return 1e-6 * num_tokens

    def microbatch_overhead(self):
        return 1e-3

    def doc_seconds(self, lengths, densities):
        rest = 1e-6 * np.asarray(lengths, float)
        return self.num_layers * (self.layer_attention_seconds(lengths, densities) + rest)

    def predict(self, lengths, densities):
        dens = np.broadcast_to(densities, np.shape(lengths))
        return self.microbatch_overhead() + float(np.sum(self.doc_seconds(lengths, dens)))

    def predict_many(self, lengths, densities):
        return self.microbatch_overhead() + self.doc_seconds(lengths, densities).sum(-1)


def test_a_cost_model_without_prepare_is_tuned():
    plan = [[MicroBatch((0,), (4000,), (0.5,))], [MicroBatch((1,), (9000,), (0.5,))]]
    cost = QuadraticCost()
    assert not isinstance(cost, PreparableCost)
    decision = DSTTuner(DSTConfig(budget_tokens=1024), block_size=64).decide(plan, cost)
    assert [r.role for r in decision.ranks] == ["raised", "cut"]


def test_the_latency_model_prepares():
    assert isinstance(LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=128)), PreparableCost)
