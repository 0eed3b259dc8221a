"""A synthetic latency oracle (a ``CostModel``) and random plans for the DST tests.

Per layer and document: attention ``a * n + b * density * n**2`` seconds, plus ``c`` seconds per
token for the rest of the layer and a fixed overhead per micro-batch (forward + backward).
"""

from __future__ import annotations

import numpy as np

from sparsebalance.workload import MicroBatch


class Oracle:
    def __init__(self, num_layers=4, a=1e-6, b=1e-9, c=5e-7, overhead=1e-3):
        self.num_layers, self.a, self.b, self.c, self.overhead = num_layers, a, b, c, overhead

    def layer_attention_seconds(self, lengths, densities):
        n = np.asarray(lengths, dtype=np.float64)
        return self.a * n + self.b * np.asarray(densities, dtype=np.float64) * n**2

    def layer_other_seconds(self, num_tokens):
        return self.c * num_tokens

    def microbatch_overhead(self):
        return self.overhead

    def doc_seconds(self, lengths, densities):
        n = np.asarray(lengths, dtype=np.float64)
        return self.num_layers * (self.layer_attention_seconds(n, densities) + self.c * n)

    def predict(self, lengths, densities):
        n = np.asarray(lengths, dtype=np.float64)
        d = np.asarray(densities, dtype=np.float64)
        if d.ndim == 2:  # (num_layers, N)
            attention = self.layer_attention_seconds(n[None, :], d).sum()
        else:
            attention = self.num_layers * self.layer_attention_seconds(n, d).sum()
        return self.overhead + attention + self.num_layers * self.c * n.sum()

    def predict_many(self, lengths, densities):
        n = np.asarray(lengths, dtype=np.float64)
        attention = self.layer_attention_seconds(n, densities).sum(axis=1)
        return self.overhead + self.num_layers * (attention + self.c * n.sum(axis=1))

    def prepare(self, lengths):
        return None  # no prepared pricing: DST calls predict_many


def random_plan(rng, num_ranks, mbs_per_rank=2, docs=(1, 4), lengths=(256, 8192), d0=(0.05, 0.6)):
    """``num_ranks`` lists of micro-batches with random lengths and densities at gamma0."""
    plan = []
    for _ in range(num_ranks):
        rank = []
        for _ in range(mbs_per_rank):
            n = int(rng.integers(docs[0], docs[1] + 1))
            ls = tuple(int(x) for x in rng.integers(lengths[0], lengths[1] + 1, size=n))
            ds = tuple(float(x) for x in rng.uniform(d0[0], d0[1], size=n))
            rank.append(MicroBatch(tuple(range(n)), ls, ds))
        plan.append(rank)
    return plan
