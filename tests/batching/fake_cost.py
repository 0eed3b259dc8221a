"""A small analytic CostModel for the batching tests (the planner may only rely on the protocol)."""

from __future__ import annotations

import numpy as np


class FakeCost:
    """``c0 + sum(a L + b d L^2)`` per micro-batch, plus optionally ``e * (pack tokens)^2``: a
    non-additive term the planner's additive view does not see (like a real model's
    token-proportional part, which is not exactly linear in the pack size)."""

    num_layers = 2

    def __init__(self, a=1e-4, b=1e-8, c0=1e-3, e=0.0):
        self.a, self.b, self.c0, self.e = a, b, c0, e

    def doc_seconds(self, lengths, densities):
        n = np.asarray(lengths, dtype=np.float64)
        return self.a * n + self.b * np.asarray(densities, dtype=np.float64) * n * n

    def microbatch_overhead(self):
        return self.c0

    def predict_many(self, lengths, densities):
        n = np.asarray(lengths, dtype=np.float64)
        return self.c0 + self.doc_seconds(n, densities).sum(-1) + self.e * n.sum(-1) ** 2

    def predict(self, lengths, densities):
        n = np.asarray(lengths, dtype=np.float64)[None]
        d = np.broadcast_to(np.asarray(densities, dtype=np.float64), n.shape[1:])[None]
        return float(self.predict_many(n, d)[0])

    def layer_attention_seconds(self, lengths, densities):
        n = np.asarray(lengths, dtype=np.float64)
        return self.b * np.asarray(densities) * n * n / self.num_layers

    def layer_other_seconds(self, num_tokens):
        return self.a * num_tokens / self.num_layers

    def prepare(self, lengths):
        return None  # no prepared pricing: DST calls predict_many


def fake_context(cost=None, per_node: int = 4, bandwidth: float = 1e9, **kwargs):
    """A :class:`~sparsebalance.latency.context.ContextCost` over ``FakeCost`` (what ``sab-cp``
    needs): ``per_node`` ranks per node, inter-node links 8x slower than ``bandwidth``."""
    from sparsebalance.latency.context import ContextCost, Links

    links = Links(bandwidth, bandwidth / 8, per_node, latency_s=1e-6, source="test")
    return ContextCost(cost or FakeCost(), links, 64.0, 64.0, block_size=64, **kwargs)
