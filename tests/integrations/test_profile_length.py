"""Issue 43's drift: the length a latency profile is measured at was ``min(capacity, the global
batch's longest documents together)`` in ``sparsebalance train`` but the capacity alone in the
integrations, so ``hf.enable(capacity=1_000_000)`` over short documents profiled a million
tokens. Both ask the engine's :func:`~sparsebalance.engine.profile_length` now."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.engine import profile_length

pytest.importorskip("transformers")


def test_a_huge_capacity_over_short_documents_profiles_the_documents(monkeypatch):
    from sparsebalance.engine import startup
    from sparsebalance.integrations import PlannerConfig
    from sparsebalance.integrations.setup import latency_model
    from sparsebalance.latency import LatencyModel, analytic_profile
    from sparsebalance.models import load_shapes
    from sparsebalance.models.hf import build_model

    asked = []

    def fake(shapes, device, dtype, backend, block_size, **kw):
        asked.append(kw["max_len"])
        return LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=block_size))

    monkeypatch.setattr(startup, "default_latency_model", fake)
    lengths = np.array([300, 120, 90, 500, 410, 60, 75, 200, 310, 100])
    config = PlannerConfig(global_batch=4, micro_batches=2, capacity=1_000_000, block_size=64)
    latency_model(build_model("tiny"), config, None, lengths, None, "cpu", "fp32")
    # the 4 longest documents together: no micro-batch of a step can hold more
    assert asked == [500 + 410 + 310 + 300]


def test_the_profile_length_is_the_trainers_rule():
    lengths = np.array([300, 120, 90, 500])
    assert profile_length(1_000_000, lengths, 2) == 800  # the 2 longest together
    assert profile_length(600, lengths, 2) == 600  # the capacity bounds a micro-batch
    assert profile_length(64, lengths, 2) == 256  # the quick profile needs two lengths
    assert profile_length(None, lengths, 2) == 500  # no capacity: the longest document
    assert profile_length(None, lengths, 2, max_len=4096) == 4096  # or the crop
