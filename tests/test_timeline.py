"""The step timeline: units per rank from a synthetic hybrid plan (predicted) and from
metrics.jsonl records (measured); a CP unit is drawn as one bar spanning its ranks."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.timeline import draw_timeline, plan_bars, record_bars
from sparsebalance.workload import Sample
from tests.batching.fake_cost import fake_context


@pytest.fixture(scope="module")
def hybrid_plan():
    """4 ranks, capacity 2048: document 99 (6,000 tokens, ~3x the capacity) must span >= 3 ranks."""
    rng = np.random.default_rng(0)
    samples = [Sample(i, int(n)) for i, n in enumerate(rng.integers(200, 1500, 10))]
    samples.append(Sample(99, 6000))
    dens = rng.uniform(0.3, 1.0, len(samples))
    cfg = PlanConfig(4, None, 2048, "sab-cp")
    return plan_batch(samples, fake_context(), cfg, densities=dens)


def test_plan_bars_span_the_units_ranks_and_never_overlap_on_a_rank(hybrid_plan):
    bars = plan_bars(hybrid_plan)
    units, rank_units = hybrid_plan.execution()
    assert sorted(b.slot for b in bars) == sorted(u.slot for u in units)  # each unit once
    (cp,) = [b for b in bars if 99 in b.sample_ids]
    assert cp.degree >= 3 and cp.contiguous
    assert cp.start == max(cp.arrivals)  # it starts when its last rank is free
    for r, order in enumerate(rank_units):
        mine = sorted((b for b in bars if r in b.ranks), key=lambda b: b.start)
        assert [b.slot for b in mine] == [units[u].slot for u in order]  # the rank's own order
        for a, b in itertools.pairwise(mine):
            assert a.end <= b.start + 1e-12
        # a rank's predicted time is the end of its last unit (waits before CP units included)
        assert mine[-1].end == pytest.approx(hybrid_plan.rank_times[r], rel=1e-9)


def _records(stamped: bool) -> list[dict]:
    """Step records of 4 ranks: a CP unit (slot 0) on ranks 1-3 that rank 3 reaches late, then
    one-rank micro-batches; rank 0 runs two micro-batches."""

    def unit(slot, ranks, start, secs, wait=0.0, ids=(1,)):
        return {
            "slot": slot,
            "ranks": ranks,
            "degree": max(len(ranks), 1),
            "sample_ids": list(ids),
            "start_s": start if stamped else None,
            "seconds": secs,
            "ring_wait_s": wait,
        }

    return [
        {"rank": 0, "units": [unit(1, [], 0.0, 1.0, ids=(5,)), unit(2, [], 1.0, 1.5)]},
        {"rank": 1, "units": [unit(0, [1, 2, 3], 0.0, 2.5, wait=0.6, ids=(17,))]},
        {"rank": 2, "units": [unit(0, [1, 2, 3], 0.0, 2.5, wait=0.55, ids=(17,))]},
        {"rank": 3, "units": [unit(0, [1, 2, 3], 0.5, 2.0, wait=0.1, ids=(17,)), unit(3, [], 2.5, 0.25)]},
    ]


@pytest.mark.parametrize("stamped", [True, False], ids=["start-stamps", "back-to-back"])
def test_record_bars_join_a_units_ranks(stamped):
    bars = record_bars(_records(stamped))
    (cp,) = [b for b in bars if b.degree == 3]
    assert cp.ranks == (1, 2, 3) and cp.sample_ids == (17,) and cp.ring_wait == 0.6
    assert len(bars) == 4  # 3 one-rank micro-batches + the CP unit, drawn once
    if stamped:  # starts when rank 3 arrives, ends with the last rank
        assert (cp.start, cp.seconds, cp.arrivals) == (0.5, 2.0, (0.0, 0.0, 0.5))
    else:  # no stamps: the last-arriving rank's seconds, from when all ranks are free
        assert (cp.start, cp.seconds) == (0.0, 2.0)
    tail = [b for b in bars if b.ranks == (3,)]
    assert tail[0].start == pytest.approx(cp.end)


def test_old_records_without_units_fall_back_to_microbatch_times():
    bars = record_bars([{"rank": 0, "microbatch_s": [1.0, 2.0]}, {"rank": 1, "microbatch_s": [3]}])
    assert [(b.ranks, b.start, b.seconds) for b in bars] == [((0,), 0.0, 1.0), ((1,), 0.0, 3.0), ((0,), 1.0, 2.0)]


def test_a_cp_unit_is_one_bar_over_its_ranks(hybrid_plan):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, ax = plt.subplots()
    bars = plan_bars(hybrid_plan)
    draw_timeline(ax, bars, hybrid_plan.num_ranks)
    (cp,) = [b for b in bars if 99 in b.sample_ids]
    filled = [p for p in ax.patches if p.get_facecolor()[3] > 0]
    tall = [p for p in filled if p.get_height() > 1]
    assert len(tall) == 1 and tall[0].get_height() == pytest.approx(cp.degree - 1 + 0.8)
    assert tall[0].get_x() == pytest.approx(cp.start)
    assert len(filled) == len(bars)  # one bar per unit
    # ranks that are not neighbours: one bar per rank, linked by a line
    fig2, ax2 = plt.subplots()
    split = next(b for b in record_bars(_records(True)) if b.degree == 3)
    draw_timeline(ax2, [replace(split, ranks=(0, 2, 3))], 4)
    assert len([p for p in ax2.patches if p.get_facecolor()[3] > 0]) == 3 and ax2.lines
    plt.close(fig)
    plt.close(fig2)


def test_the_legend_names_each_colour_link_and_hatching_drawn_beside_the_axis():
    plt = pytest.importorskip("matplotlib.pyplot")
    bars = record_bars(_records(True))  # rank 3 reaches the CP unit 0.5 s after ranks 1 and 2
    fig, ax = plt.subplots()
    draw_timeline(ax, bars, 4)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [
        "micro-batch on one rank",
        "CP unit over 3 ranks",
        "waiting for the unit's\nlast rank (up to 500 ms)",
    ]
    fig.canvas.draw()
    assert not ax.get_legend().get_window_extent().overlaps(ax.get_window_extent())
    # no wait, ranks not neighbours: the link is named and the hatching is not
    fig2, ax2 = plt.subplots()
    split = next(b for b in bars if b.degree == 3)
    draw_timeline(ax2, [replace(split, ranks=(0, 2, 3), arrivals=())], 4)
    labels = [t.get_text() for t in ax2.get_legend().get_texts()]
    assert labels == ["CP unit over 3 ranks", "one CP unit on ranks\nthat are not neighbours"]
    plt.close(fig)
    plt.close(fig2)
