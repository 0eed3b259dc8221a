"""PNG plots of simulation results (matplotlib, Agg backend; imported only when plotting).

- :func:`plot_speedup`: speed-up vs baseline against world size, one line per strategy;
- :func:`plot_rank_times`: the per-rank predicted compute time of one step, ranks sorted, one
  line per strategy, with each strategy's step time (the slowest rank) dashed: the area between
  a line and its dash is the bubble.

Legends sit beside the axes, never over the lines; long titles wrap; files are written atomically.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from ..results import write_file


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'sparsebalance[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(summary: dict, path: str | Path, title: str = "") -> Path:
    """Speed-up (mean baseline step / mean step) vs world size from :func:`run_simulation`'s
    output; log-2 x axis. Returns the PNG path."""
    plt = _pyplot()
    results = summary["results"]
    sizes = [res["world_size"] for res in results]
    fig, ax = plt.subplots(figsize=(8.5, 4.5), layout="constrained")
    for name in results[0]["strategies"]:
        ys = [res["strategies"][name]["speedup"] for res in results]
        ax.plot(sizes, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("data-parallel ranks")
    ax.set_ylabel("speed-up vs baseline (predicted)")
    ax.set_title(_wrap(title or f"simulated speed-up, {summary['cost_model']}"), fontsize=9)
    ax.grid(alpha=0.3)
    _legend_beside(ax)
    return _save(fig, path)


def plot_rank_times(result: dict, path: str | Path, title: str = "") -> Path:
    """Per-rank predicted compute seconds of step ``result['show_step']`` (one world size)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8.5, 4.5), layout="constrained")
    for i, (name, times) in enumerate(result["rank_times"].items()):
        ys = sorted(times)
        color = f"C{i % 10}"
        ax.plot(range(len(ys)), ys, color=color, label=name, lw=1.2)
        ax.axhline(max(ys), color=color, ls="--", lw=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # ranks are whole numbers
    ax.set_xlabel("rank (sorted by predicted time)")
    ax.set_ylabel("predicted compute seconds")
    ax.set_title(
        _wrap(
            title or f"{result['world_size']} ranks, step {result['show_step']} (dashed: step time, the slowest rank)"
        ),
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    _legend_beside(ax)
    return _save(fig, path)


def _wrap(title: str) -> str:
    return "\n".join(textwrap.wrap(title, 90))


def _legend_beside(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


def _save(fig, path) -> Path:
    plt = _pyplot()
    try:
        write_file(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return Path(path)
