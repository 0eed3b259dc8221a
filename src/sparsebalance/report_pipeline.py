"""The pipeline part of a run's report (``--pp P``): each stage's busy time and its bubble (the
pipeline's span less the stage's own forward + backward), from the ``stages`` of the per-rank
records in ``metrics.jsonl`` (:class:`~sparsebalance.engine.records.RankRecord`)."""

from __future__ import annotations

import numpy as np


def stage_means(ranks: list[dict], skip_first: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
    """``(busy, idle)`` seconds per stage, means over the run's steps (the warm-up step left out
    when there are others) and pipelines; None for a run without a pipeline."""
    rows = [r for r in ranks if r.get("stages")]
    if not rows:
        return None
    first = min(r["step"] for r in rows)
    body = [r for r in rows if r["step"] != first] if skip_first and len({r["step"] for r in rows}) > 1 else rows
    busy = np.mean([[s["busy_s"] for s in r["stages"]] for r in body], axis=0)
    idle = np.mean([[s["idle_s"] for s in r["stages"]] for r in body], axis=0)
    return busy, idle


def pipeline_bubble(ranks: list[dict]) -> float | None:
    """The pipelines' bubble fraction: the stages' idle seconds over their span (busy + idle),
    means over steps as :func:`stage_means`; None for a run without a pipeline. What a ``--pp``
    run's summary shows as its bubble (its data-parallel one is 0 with one pipeline)."""
    means = stage_means(ranks)
    if means is None:
        return None
    busy, idle = means
    return float(idle.sum() / max(busy.sum() + idle.sum(), 1e-12))


def pipeline_line(ranks: list[dict]) -> str:
    """One line: the stages, their mean busy seconds and bubble share; empty without a pipeline."""
    means = stage_means(ranks)
    if means is None:
        return ""
    busy, idle = means
    chunks = max((s.get("chunks", 1) for r in ranks for s in r.get("stages", ())), default=1)
    schedule = f"interleaved 1F1B, {chunks} chunks a stage" if chunks > 1 else "1F1B"
    stages = [s for r in ranks for s in r.get("stages", ())]
    if any(s.get("schedule") == "zb-h1" for s in stages):
        weight = sum(s.get("weight_s", 0.0) for s in stages) / max(sum(s["busy_s"] for s in stages), 1e-12)
        ops = [x for r in ranks for u in r.get("units", ()) for x in u.get("stage_s", ()) if len(x) == 3]
        backward = sum(x[1] for x in ops)  # (forward, B + W, W) per stage: what the pricing learns
        share = f", {100 * sum(x[2] for x in ops) / backward:.0f} % of the backward" if backward > 0 else ""
        schedule = f"zero bubble ZB-H1, W {100 * weight:.0f} % of the busy time{share}"
    parts = ", ".join(
        f"stage {s} busy {b:.3f} s, bubble {i:.3f} s ({100 * i / max(b + i, 1e-12):.0f} %)"
        for s, (b, i) in enumerate(zip(busy, idle, strict=True))
    )
    return f"{len(busy)} stages per pipeline ({schedule}), mean per step: {parts}."


def pipeline_figure(run_data: dict):
    """``pipeline.png``: per run and stage, mean busy and bubble seconds per step (stacked)."""
    import matplotlib.pyplot as plt

    runs = {name: stage_means(ranks) for name, (ranks, _) in run_data.items()}
    runs = {name: m for name, m in runs.items() if m is not None}
    fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
    labels, x = [], 0
    for name, (busy, idle) in runs.items():
        for s, (b, i) in enumerate(zip(busy, idle, strict=True)):
            ax.bar(x, b, color="tab:blue", label="busy" if x == 0 else None)
            ax.bar(x, i, bottom=b, color="tab:gray", alpha=0.5, label="bubble" if x == 0 else None)
            labels.append(f"{name}\nstage {s}")
            x += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set(title="pipeline stages: busy and bubble per step (mean)", ylabel="seconds per step")
    ax.legend()
    return fig
