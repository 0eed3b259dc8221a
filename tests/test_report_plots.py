"""The report's figures, checked as matplotlib objects (not pixels): panels compared on one scale,
whole-number step ticks, legends beside the data and naming what is drawn, titles that say what
the panels show; and the simulator's plots with their legends beside the lines."""

from __future__ import annotations

import pytest

from sparsebalance import report

plt = pytest.importorskip("matplotlib.pyplot")
from matplotlib.patches import Patch  # noqa: E402

NUM_STEPS = 20


def _unit(slot, ranks, start, secs, ids):
    return {
        "slot": slot,
        "ranks": ranks,
        "degree": max(len(ranks), 1),
        "ring": "flat",
        "sample_ids": ids,
        "tokens": 1000,
        "start_s": start,
        "seconds": secs,
        "ring_wait_s": 0.0,
    }


def _run(scale: float, cp_step: int | None, late: float = 0.0, kind: str = "top-k"):
    """Per-rank records and step lines of a 2-rank run of NUM_STEPS steps; at ``cp_step`` the
    ranks share one CP unit (rank 1 reaching it ``late`` seconds after rank 0)."""
    ranks, steps = [], []
    for step in range(1, NUM_STEPS + 1):
        for r in (0, 1):
            if step == cp_step:
                units = [_unit(0, [0, 1], late * r, scale - late * r, [9]), _unit(1, [], scale, 0.5 * scale, [r])]
            else:
                units = [_unit(0, [], 0.0, scale * (1 + r), [r])]
            ranks.append(
                {
                    "step": step,
                    "rank": r,
                    "compute_s": scale * (1 + r),
                    "derived_bubble_s": scale * (1 - r),
                    "budget_mean": 8.0 + r,
                    "density": 0.5 + 0.1 * r,
                    "units": units,
                }
            )
        steps.append(
            {
                "step": step,
                "rank": "all",
                "loss": 5.0 - 0.1 * step,
                "step_seconds": 2 * scale,
                "max_compute_s": 2 * scale,
                "efficiency": 0.75,
                "bubble_fraction": 0.25,
                "mean_density": 0.55,
                "tokens_per_s": 1e3,
                "overhead_s": 0.01,
                "budget_kind": kind,
            }
        )
    return ranks, steps


@pytest.fixture
def figures(monkeypatch, tmp_path):
    """Draw the report's figures of ``run_data``; returns {file name: Figure} (kept open)."""
    drawn = {}

    def keep(fig, path):
        drawn[path.name] = fig
        return path.name

    monkeypatch.setattr(report, "_save", keep)

    def draw(run_data):
        drawn.clear()
        report._plots(run_data, tmp_path)
        for fig in drawn.values():
            fig.canvas.draw()  # lays the figure out: legend and axes extents are final
        return dict(drawn)

    yield draw
    plt.close("all")


def _two_runs(late=0.4):
    # the baseline is 4x slower (its bars 4x taller); only the second run has a CP unit, at step 3
    return {"baseline": _run(4.0, None), "sparsebalance": _run(1.0, 3, late)}


def _legends(fig):
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]


def _labels(legend):
    return [t.get_text() for t in legend.get_texts()]


def _no_legend_over_a_panel(fig):
    legends = _legends(fig)
    assert legends, "no legend"
    for legend in legends:
        box = legend.get_window_extent()
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent()), f"legend over {ax.get_title()!r}"


def _whole_steps(ax):
    lo, hi = ax.get_xlim()
    shown = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert len(shown) >= 2 and all(float(t).is_integer() for t in shown), shown


def test_timeline_panels_share_one_y_scale_with_whole_steps_and_the_legend_beside(figures):
    fig = figures(_two_runs())["timeline.png"]
    base, sb = fig.axes
    assert base.get_ylim() == sb.get_ylim()  # the 4x taller bars are 4x taller on the page
    assert base.get_shared_y_axes().joined(base, sb)
    for ax in (base, sb):
        _whole_steps(ax)
        assert ax.get_xlabel() == "step"
    assert base.get_ylabel() == "seconds"
    _no_legend_over_a_panel(fig)
    (legend,) = _legends(fig)
    labels = _labels(legend)
    assert labels[:2] == ["rank 0 compute", "rank 1 compute"]
    assert any(label.startswith("bubble") for label in labels)


def _panel_step(ax):
    return ax.get_title().rpartition("step ")[2]


def test_units_compares_the_same_step_in_both_runs_on_one_time_scale(figures):
    fig = figures(_two_runs())["units.png"]
    base, sb = fig.axes
    # the run with a CP unit decides the step (3), and the baseline shows its step 3 too
    assert _panel_step(base) == _panel_step(sb) == "3"
    assert "step 3 in every run" in fig.get_suptitle()
    assert base.get_xlim() == sb.get_xlim()
    _no_legend_over_a_panel(fig)


@pytest.mark.parametrize("late", [0.4, 0.0], ids=["a-rank-waits", "no-wait"])
def test_units_legend_names_every_colour_and_titles_match_what_is_drawn(figures, late):
    fig = figures(_two_runs(late))["units.png"]
    for ax in fig.axes:
        filled = {p.get_facecolor() for p in ax.patches if p.get_facecolor()[3] > 0}
        hatched = [p for p in ax.patches if p.get_hatch()]
        legend = ax.get_legend()
        assert legend is not None, ax.get_title()
        named = {h.get_facecolor() for h in legend.legend_handles if isinstance(h, Patch) and not h.get_hatch()}
        assert filled <= named, "a colour without a legend entry"
        waiting = [t for t in _labels(legend) if t.startswith("waiting")]
        assert bool(waiting) == bool(hatched)  # the hatching is named where, and only where drawn
        assert ("CP unit over 2 ranks" in _labels(legend)) == (ax is fig.axes[1])
    titles = [fig.get_suptitle(), *(ax.get_title() for ax in fig.axes)]
    assert not any("hatch" in t for t in titles)  # the legend says it, when there is hatching


def test_budget_density_both_panels_labelled_and_the_right_one_has_a_legend(figures):
    fig = figures(_two_runs())["budget_density.png"]
    budget, density = fig.axes
    assert budget.get_ylabel() == "k (top-k)" and density.get_ylabel().startswith("density")
    legend = density.get_legend()
    assert legend is not None
    assert _labels(legend) == [line.get_label() for line in density.get_lines()]
    assert _labels(legend)[0] == "baseline, rank 0"
    for ax in (budget, density):
        _whole_steps(ax)
    _no_legend_over_a_panel(fig)


def test_a_gamma_run_labels_its_budget_axis_gamma(figures):
    fig = figures({"run": _run(1.0, None, kind="gamma")})["budget_density.png"]
    assert fig.axes[0].get_ylabel() == "gamma"


def test_loss_has_whole_step_ticks(figures):
    _whole_steps(figures(_two_runs())["loss.png"].axes[0])


def test_simulator_plots_keep_their_legends_beside_the_lines(tmp_path, monkeypatch):
    from sparsebalance.simulate import plots

    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: kept.append(fig))
    names = ["baseline", "sab", "dst", "sab+dst"]
    results = [
        {
            "world_size": w,
            "show_step": 0,
            "strategies": {n: {"speedup": 1 + i * w / 10} for i, n in enumerate(names)},
            "rank_times": {n: [0.1 * (r + 1) / (1 + i) for r in range(w)] for i, n in enumerate(names)},
        }
        for w in (2, 4, 16)
    ]
    plots.plot_speedup({"results": results, "cost_model": "a long cost model name " * 6}, "x")
    plots.plot_rank_times(results[-1], "y")
    for fig in kept:
        fig.canvas.draw()
        _no_legend_over_a_panel(fig)
        (ax,) = fig.axes
        lo, hi = ax.get_xlim()
        assert all(float(t).is_integer() for t in ax.get_xticks() if lo <= t <= hi)
        page, title = fig.bbox, ax.title.get_window_extent()
        assert page.x0 <= title.x0 and title.x1 <= page.x1, ax.get_title()  # not cut off
    plt.close("all")
