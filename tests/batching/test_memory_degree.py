"""``sab-cp`` with a memory bound (``--capacity auto``): each document's minimum CP degree comes
from the memory model, and documents that fit on no R ranks follow ``--overlong``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig, check_units, plan_batch
from sparsebalance.cli import main
from sparsebalance.latency.memory import ANALYTIC, GIB, MemoryConfig, MemoryModel
from sparsebalance.latency.memory_bound import MemoryBound
from sparsebalance.models import load_shapes
from sparsebalance.workload import Sample
from tests.batching.fake_cost import fake_context

# the analytic latency profiles end below the longest documents planned here
pytestmark = pytest.mark.filterwarnings("ignore:latency model. some inputs lie outside")


class HalfBound:
    """A memory bound under which a document needs twice the ranks ``ceil(L / C)`` says."""

    def __init__(self, capacity: int):
        self.c = capacity // 2

    def min_degree(self, lengths, max_degree):
        k = -(-np.asarray(lengths, dtype=np.int64) // self.c)
        return np.where(k > max_degree, max_degree + 1, k)

    def max_document(self, degree):
        return degree * self.c


def test_sab_cp_takes_the_minimum_degree_from_the_memory_bound():
    cap, r = 2000, 8
    samples = [Sample(0, 5000), Sample(1, 9000), *[Sample(10 + i, 300) for i in range(40)]]
    dens = np.full(len(samples), 0.5)
    cfg = PlanConfig(r, capacity=cap, strategy="sab-cp")
    # slow links: splitting costs time, so only memory pushes a document past its minimum
    plain = plan_batch(samples, fake_context(bandwidth=1e6), cfg, dens)
    bounded = plan_batch(samples, fake_context(bandwidth=1e6, memory=HalfBound(cap)), cfg, dens)
    for plan in (plain, bounded):
        units, rank_units = plan.execution()
        check_units(units, rank_units, {s.id: s.num_tokens for s in samples}, cap)
    deg = {u.sample_ids[0]: u.degree for u in plain.execution()[0] if u.degree > 1}
    assert deg[0] >= 3 and deg[1] >= 5  # ceil(L / C)
    units = bounded.execution()[0]
    deg = {u.sample_ids[0]: u.degree for u in units if u.degree > 1}
    assert deg[0] >= 5  # ceil(5000 / 1000): the memory bound's minimum, not ceil(5000 / 2000)
    # 9000 tokens fit on no 8 ranks under the bound (8 x 1000): split by --overlong into
    # chunks of the bound's longest document, each on >= its own minimum
    assert bounded.metrics.num_overlong == 1 and plain.metrics.num_overlong == 0
    chunks = sorted((o, n) for u in units for i, o, n in zip(u.sample_ids, u.offsets, u.lengths, strict=True) if i == 1)
    assert chunks == [(0, 8000), (8000, 1000)]
    assert any(u.sample_ids == (1,) and u.lengths == (8000,) and u.degree == 8 for u in units)


def bound_3b(gib: float = 70.0, ranks: int = 32) -> MemoryBound:
    # plan --capacity auto's with --parallel fsdp2 (its gradients reduce-scattered every micro-batch)
    cfg = MemoryConfig("full", "chunked", shard=ranks, micro_batches=2, reduce_every=True, block_size=128)
    return MemoryBound(MemoryModel(load_shapes("qwen2.5-3b"), ANALYTIC["a100"]), gib * GIB, cfg)


def test_memory_bound_minimum_degree_is_the_smallest_that_fits():
    bound = bound_3b()
    cap = bound.capacity()
    lengths = np.array([4096, cap, cap + 1, 262_144, 524_288, 1_048_576])
    k = bound.min_degree(lengths, 32)
    assert k[:2].tolist() == [1, 1]
    # the cost model's minimum: ceil(L / C) and the bound's, whichever is larger
    both = fake_context(memory=bound).min_degree(lengths, cap, 32)
    assert both.tolist() == np.maximum(k, -(-lengths // cap)).tolist() and both[2] == 2
    for n, kk in zip(lengths.tolist(), k.tolist(), strict=True):
        assert bound.fits(n, kk) and (kk == 1 or not bound.fits(n, kk - 1))
    # at 512K the whole document's layout metadata and the ring buffer need more ranks than
    # ceil(L / C) (this is what the planner would get wrong from C alone)
    assert k[4] > -(-524_288 // cap)
    assert bound.max_document(32) > 524_288 and not bound.fits(bound.max_document(32) + 128 * 32, 32)


def test_plan_capacity_auto_sets_c_and_cp_degrees(tmp_path, capsys):
    """``plan --capacity auto``: C from the memory model, MTraining's 512K document on a unit of
    at least the memory model's minimum degree, every rank of it within the budget."""
    lengths = tmp_path / "lengths.txt"
    rng = np.random.default_rng(0)
    lengths.write_text("\n".join(map(str, [524_288, *rng.integers(4096, 16384, 64).tolist()])))
    save = tmp_path / "plans.json"
    rc = main(
        [
            "plan",
            "--lengths",
            str(lengths),
            "--world-size",
            "32",
            "--capacity",
            "auto",
            "--strategy",
            "sab-cp",
            "--model",
            "qwen2.5-3b",
            "--accelerator",
            "a100",
            "--memory-budget",
            "70GiB",
            "--activation-checkpointing",
            "full",
            "--parallel",
            "fsdp2",
            "--save",
            str(save),
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    bound = bound_3b()
    assert out["capacity"] == bound.capacity() and out["capacity_source"] == "memory model"
    plan = json.loads(save.read_text())["strategies"]["sab-cp"]
    (unit,) = [u for u in plan["units"] if u["documents"][0]["length"] == 524_288]
    k = len(unit["ranks"])
    assert k >= int(bound.min_degree(np.array([524_288]), 32)[0]) > -(-524_288 // out["capacity"])
    assert bound.fits(524_288, k)


def test_plan_capacity_flag_errors(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n200\n")
    base = ["plan", "--lengths", str(lengths), "--world-size", "2"]
    assert main([*base, "--capacity", "lots"]) == 2
    assert "--capacity" in capsys.readouterr().err
    assert main([*base, "--capacity", "auto", "--memory-budget", "1MB", "--model", "qwen2.5-3b"]) == 2
    assert "--memory-budget" in capsys.readouterr().err


def test_plan_overlong_note_names_the_strategies(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n5000\n9000\n")
    rc = main(["plan", "--lengths", str(lengths), "--world-size", "4", "--capacity", "2000", "--strategy", "all"])
    assert rc == 0
    text = capsys.readouterr().out
    # C = 2000: two documents are over-long for the whole-document strategies; R x C = 8000:
    # one for sab-cp. Each count is printed with the strategies it belongs to.
    assert "2 documents longer than C (sequential, sorted, lbb, tokens, flops, sab)" in text
    assert "1 documents longer than a unit of R = 4 ranks (sab-cp)" in text
    rc = main(["plan", "--lengths", str(lengths), "--world-size", "4", "--capacity", "2000", "--strategy", "sab"])
    assert "2 documents longer than C: --overlong split" in capsys.readouterr().out
