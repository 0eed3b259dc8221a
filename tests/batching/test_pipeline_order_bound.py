"""Issue 55 (bad): ``simulate --pp 2 --capacity 1`` took all 23 GB of memory. The 1F1B order
search prices M^2 / 2 orders of M micro-batches per round, for every candidate rank of every
exchange step, all at once: cubic in the micro-batches per pipeline (``--capacity 256`` already
asked for 2.2 GB in one array). Now the search is chunked (bounded memory, same answer), skipped
above :data:`ORDER_SEARCH_MAX` micro-batches per pipeline (ascending order), and the simulator
says so."""

from __future__ import annotations

import tracemalloc

import numpy as np

from sparsebalance.batching import PlanConfig, pipeline, plan_batch
from sparsebalance.batching.pipeline import ORDER_SEARCH_MAX, PipelineShape, best_orders
from sparsebalance.cli import main
from sparsebalance.workload import Sample

from .fake_cost import FakeCost


class EightLayers(FakeCost):
    num_layers = 8


def _peak_mib(call) -> float:
    tracemalloc.start()  # numpy's buffers are traced
    try:
        call()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def test_many_pipelines_are_searched_in_bounded_memory(monkeypatch):
    shape = PipelineShape.of(8, 2)
    times = np.random.default_rng(0).lognormal(0.0, 1.0, (96, 16))
    monkeypatch.setattr(pipeline, "CHUNK_ELEMENTS", 1 << 40)  # all 96 pipelines at once
    at_once = _peak_mib(lambda: best_orders(times, shape))
    want = best_orders(times, shape)
    monkeypatch.setattr(pipeline, "CHUNK_ELEMENTS", 1 << 16)  # ~17 at a time
    chunked = _peak_mib(lambda: best_orders(times, shape))
    assert chunked < at_once / 3
    got = best_orders(times, shape)  # the same answer
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_above_the_bound_the_order_is_ascending_and_unsearched():
    shape = PipelineShape.of(8, 2)
    times = np.random.default_rng(1).lognormal(0.0, 1.0, (3, ORDER_SEARCH_MAX + 1))
    orders, spans = best_orders(times, shape)
    assert np.array_equal(orders, np.argsort(times, axis=1, kind="stable"))
    assert np.allclose(spans, shape.makespans(np.sort(times, axis=1)))


def test_a_plan_with_too_many_micro_batches_per_pipeline_says_its_order_was_not_searched():
    rng = np.random.default_rng(2)
    lens = rng.integers(200, 2000, 16)
    samples = [Sample(i, int(n)) for i, n in enumerate(lens)]
    config = PlanConfig(2, capacity=64, strategy="sab", pipeline_stages=2)  # ~70 per pipeline
    plan = plan_batch(samples, EightLayers(), config, rng.uniform(0.1, 1.0, lens.size).tolist())
    most = max(len(r) for r in plan.ranks)
    assert most > ORDER_SEARCH_MAX and plan.metrics.order_search_skipped == most
    assert sum(mb.num_tokens for r in plan.ranks for mb in r) == int(lens.sum())  # every token once
    roomy = PlanConfig(2, capacity=4096, strategy="sab", pipeline_stages=2)
    few = plan_batch(samples, EightLayers(), roomy, [0.5] * 16)
    assert few.metrics.order_search_skipped == 0


def test_simulate_says_when_the_order_was_not_searched(capsys):
    args = ["simulate", "--pp", "2", "--capacity", "256", "--steps", "1", "--world-sizes", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    (note,) = [line for line in out.splitlines() if line.startswith("note: sab did not search")]
    assert f"more than {ORDER_SEARCH_MAX}" in note and "in 1 of 1 steps" in note
    assert main(["simulate", "--pp", "2", "--capacity", "8192", "--steps", "1", "--world-sizes", "2"]) == 0
    assert "did not search" not in capsys.readouterr().out
