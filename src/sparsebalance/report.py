"""Run reports: ``sparsebalance report RUN_DIR`` reads ``metrics.jsonl`` of one run (or of every
run folder inside RUN_DIR, e.g. the demo's baseline and sparsebalance) and writes ``report.md``
with a comparison table, a line per run on its over-long documents (trained whole over how many
ranks, or cut by ``--overlong split``) and PNG plots: per-rank timeline (compute vs bubble per
step), the last step's units per rank (context-parallel units spanning ranks), step-time
distribution per run, budget and density per rank, loss curves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .report_dst import dst_line
from .report_pipeline import pipeline_bubble, pipeline_figure, pipeline_line
from .results import markdown_table, write_file
from .timeline import draw_timeline, record_bars
from .verdict import verdict_lines


def load_run(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(per-rank records, per-step summaries) of one run."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a training run folder)")
    ranks, steps = [], []
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # torn last line (killed mid-write; no newline yet): not a step
                continue
            raise ValueError(f"{path}:{i}: not a JSON record") from None
        (steps if rec.get("rank") == "all" else ranks).append(rec)
    if not steps:
        raise ValueError(f"{path}: no completed step")
    return ranks, steps


def find_runs(root: Path) -> dict[str, Path]:
    root = Path(root)
    if (root / "metrics.jsonl").is_file():
        return {root.name: root}
    runs = {p.parent.name: p.parent for p in sorted(root.glob("*/metrics.jsonl"))}
    if not runs:
        raise ValueError(f"{root}: no metrics.jsonl here or in its sub-folders")
    return runs


def summarize(steps: list[dict]) -> dict:
    """Means over steps, skipping the first (warm-up: first-call overheads, profile loading)."""
    body = steps[1:] if len(steps) > 1 else steps
    mean = lambda k: float(np.mean([s[k] for s in body]))  # noqa: E731
    return {
        "steps": len(steps),
        "mean_step_s": mean("step_seconds"),
        "mean_max_compute_s": mean("max_compute_s"),
        "efficiency": mean("efficiency"),
        "bubble_fraction": mean("bubble_fraction"),
        "mean_density": mean("mean_density"),
        "tokens_per_s": mean("tokens_per_s"),
        "final_loss": float(steps[-1]["loss"]),
    }


def run_summary(ranks: list[dict], steps: list[dict]) -> dict:
    """:func:`summarize`, with a ``--pp`` run's bubble its pipelines' (:func:`pipeline_bubble`:
    the stages' idle share; the data-parallel bubble of one pipeline is 0)."""
    out = summarize(steps)
    bubble = pipeline_bubble(ranks)
    if bubble is not None:
        out.update(bubble_fraction=bubble, pipeline=True)
    return out


def comparison_table(
    runs: dict[str, dict], baseline: str | None = None, predicted: dict[str, dict] | None = None
) -> tuple[str, dict]:
    """The ablation table (``report``, ``train --demo``, ``bench-e2e``): markdown and JSON-ready.

    Args:
        runs: run name -> :func:`summarize` of its steps. One run has no speed-up columns (or
            ``speedup`` keys): it is compared with nothing.
        baseline: the run speed-ups are measured against (default ``baseline``, else the first).
        predicted: run name -> the simulator's summary of the same strategy (``step_seconds``,
            ``speedup``, ``mean_density``); adds the predicted speed-up and the prediction's error
            against the measured slowest-rank compute time.
    """
    base = runs[baseline_name(runs, baseline)]
    compared = len(runs) > 1
    headers = [
        "run",
        "steps",
        "mean step (s)",
        *(["speedup", "compute speedup"] * compared),
        "balance eff.",
        "bubble frac.",
        "mean density",
        "final loss",
    ]
    if predicted is not None:
        headers += ["predicted speedup", "prediction error (step)"]
    rows, out = [], {}
    for name, s in runs.items():
        entry = dict(s)
        speedups = []
        if compared:
            entry["speedup"] = base["mean_step_s"] / s["mean_step_s"]
            entry["compute_speedup"] = base["mean_max_compute_s"] / s["mean_max_compute_s"]
            speedups = [entry["speedup"], entry["compute_speedup"]]
        rows.append(
            [
                name,
                s["steps"],
                s["mean_step_s"],
                *speedups,
                s["efficiency"],
                s["bubble_fraction"],
                s["mean_density"],
                s["final_loss"],
            ]
        )
        if predicted is not None:
            p = predicted[name]
            entry.update(
                predicted_speedup=p["speedup"],
                predicted_step_s=p["step_seconds"],
                prediction_error=p["step_seconds"] / s["mean_max_compute_s"] - 1,
                predicted_density=p.get("mean_density"),
            )
            rows[-1] += [p["speedup"], f"{100 * entry['prediction_error']:+.0f} %"]
        out[name] = entry
    return markdown_table(headers, rows), out


def baseline_name(runs: dict, baseline: str | None = None) -> str:
    """The run speed-ups are measured against: ``baseline`` if given and there, else the run
    named ``baseline``, else the first."""
    for name in (baseline, "baseline"):
        if name in runs:
            return name
    return next(iter(runs))


def table_note(runs: dict, baseline: str | None = None) -> str:
    """What :func:`comparison_table`'s columns mean, for the runs it was given."""
    if len(runs) > 1:
        base = baseline_name(runs, baseline)
        speed = f"Speedup = {base}'s mean step time / the run's; compute speedup uses the slowest rank's compute time. "
    else:
        speed = "No speed-up column: one run, nothing to compare it with. "
    bubble = "bubble fraction = 1 - efficiency"
    if any(r.get("pipeline") for r in runs.values()):
        speed += "With --pp the bubble is the pipeline's: its stages' idle share of the step (each stage's below). "
        bubble = f"without --pp, {bubble}"  # a pipeline's bubble is not 1 - its balance efficiency
    steps = {r.get("steps") for r in runs.values()}
    means = "One step per run (the warm-up, kept). " if steps == {1} else "Means over steps 2..N (step 1 is warm-up). "
    return f"{means}{speed}Balance efficiency = mean / max rank compute time; {bubble}."


def long_documents(steps: list[dict]) -> str:
    """One line on a run's over-long documents: which were trained whole over how many ranks (CP
    units, ``cp_documents`` of the step lines) and how many ``--overlong split`` chunks were cut
    (``num_split_chunks``); runs before these fields say nothing (empty string)."""
    if not any("cp_documents" in s for s in steps):
        return ""
    seen: dict[tuple[int, int], dict] = {}
    for s in steps:
        for d in s.get("cp_documents", ()):
            entry = seen.setdefault((d["id"], d["offset"]), {**d, "steps": [], "degrees": set()})
            entry["steps"].append(s["step"])
            entry["degrees"].add(d["degree"])
    chunks = sum(int(s.get("num_split_chunks", 0)) for s in steps)
    cut = sum(int(s.get("num_overlong", 0)) for s in steps if s.get("num_split_chunks", 0))
    parts = []
    for (i, off), d in sorted(seen.items()):
        ks = "/".join(str(k) for k in sorted(d["degrees"]))
        where = f"document {i}" + (f" (from token {off:,})" if off else "")
        parts.append(
            f"{where}, {d['tokens']:,} tokens, on {ks} ranks ({d['ring']} ring) at step"
            f"{'s' if len(d['steps']) > 1 else ''} {', '.join(map(str, d['steps']))}"
        )
    whole = (
        f"trained whole over context-parallel ranks: {'; '.join(parts)}"
        if parts
        else "no document ran over several ranks"
    )
    split = (
        f"--overlong split cut {cut} document{'s' if cut != 1 else ''} into {chunks} chunks"
        if chunks
        else "no split counted (--overlong cut no document)"
    )
    return f"{whole}. {split}."


def budgets(ranks: list[dict], steps: list[dict]) -> str:
    """One line on a run's attention budgets: the kind, the range the ranks' budgets (mean over
    their layers) took, how far they differed within a step, the realized density, the
    coverage-bound stops and the balancing pipeline's own time; runs before these fields: empty."""
    if not ranks or "budget_mean" not in ranks[0] or "overhead_s" not in steps[0]:
        return ""
    kind = steps[-1].get("budget_kind") or "budget"
    unit = "k " if kind == "top-k" else "gamma "
    values = [r["budget_mean"] for r in ranks]
    by_step: dict[int, list[float]] = {}
    for r in ranks:
        by_step.setdefault(r["step"], []).append(r["budget_mean"])
    spread = max(max(v) - min(v) for v in by_step.values())
    body = steps[1:] if len(steps) > 1 else steps
    overhead = float(np.mean([s["overhead_s"] for s in body]))
    share = overhead / max(float(np.mean([s["step_seconds"] for s in body])), 1e-12)
    limited = sum(int(s.get("coverage_limited", 0)) for s in steps)
    fmt = "{:.1f}" if kind == "top-k" else "{:.3f}"
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    if lo == hi:  # a fixed budget: no range, no spread to speak of
        spent = f"{kind}, budget {unit}{lo} on every rank and step (mean over layers)"
    else:
        spent = (
            f"{kind}, per-rank budgets {unit}{lo} .. {hi} (mean over layers; up to "
            f"{fmt.format(spread)} apart within a step)"
        )
    stopped = f"{limited} layer cut{'s' if limited != 1 else ''}" if limited else "no layer cut"
    ahead = sum(bool(s.get("planned_ahead")) for s in body)
    shadow = f", {ahead} of {len(body)} steps planned during the previous one's device work" if ahead else ""
    return (
        f"{spent}, realized density {float(np.mean([s['mean_density'] for s in body])):.2f}, "
        f"coverage bound stopped {stopped}; planning + DST {1e3 * overhead:.1f} ms a step "
        f"({100 * share:.2f} % of it{shadow})."
    )


RunData = dict[str, tuple[list[dict], list[dict]]]
"""run name -> (per-rank records, per-step summaries), as :func:`load_run` reads them."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_steps(ax) -> None:
    """Steps are whole numbers: no 2.5 on a step axis."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def timeline_figure(run_data: RunData):
    """``timeline.png``: compute and bubble seconds per rank and step, a panel per run on one
    y scale (the runs are compared by bar height), the legend beside the panels."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    n = len(run_data)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n + 1.8, 3.5), sharey=True, squeeze=False, layout="constrained")
    num_ranks = _max_ranks(run_data)
    width = 0.8 / num_ranks
    for ax, (name, (ranks, _)) in zip(axes[0], run_data.items(), strict=True):
        for r in range(num_ranks):
            recs = [x for x in ranks if x["rank"] == r]
            x = np.array([x["step"] for x in recs]) + (r - (num_ranks - 1) / 2) * width
            comp = np.array([x["compute_s"] for x in recs])
            bub = np.array([x["derived_bubble_s"] for x in recs])
            ax.bar(x, comp, width=width, color=f"C{r}")
            ax.bar(x, bub, bottom=comp, width=width, color=f"C{r}", alpha=0.3, hatch="//")
        ax.set(title=f"{name}: compute and bubble per rank", xlabel="step")
        _integer_steps(ax)
    axes[0, 0].set_ylabel("seconds")
    handles = [Patch(color=f"C{r}", label=f"rank {r} compute") for r in range(num_ranks)]
    handles.append(Patch(facecolor="0.85", edgecolor="0.3", hatch="//", label="bubble: waiting for\nthe slowest rank"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=7)
    return fig


def _units_step(run_data: RunData) -> tuple[dict[str, int], str]:
    """The step ``units.png`` shows of each run: the same step in every run (the last in which
    any ran a CP unit, else the last), unless the runs share no step; and the reason, said."""
    steps = [{x["step"] for x in ranks} for ranks, _ in run_data.values()]
    common = set.intersection(*steps)
    cp = {
        x["step"] for ranks, _ in run_data.values() for x in ranks if any(u["degree"] > 1 for u in x.get("units", ()))
    }
    one = "" if len(run_data) == 1 else " in every run"
    if common & cp:
        step = max(common & cp)
        why = f"step {step}{one}: the last step in which a document ran over several ranks"
    elif common:
        step = max(common)
        why = f"step {step}{one}: the last step (no document ran over several ranks)"
    else:
        last = {name: max(s) for name, s in zip(run_data, steps, strict=True)}
        return last, "each run's last step (the runs have no step in common)"
    return {name: step for name in run_data}, why


def units_figure(run_data: RunData):
    """``units.png``: the units each rank ran in one step, the same step of every run (see
    :func:`_units_step`), on one time scale; the legend names every colour and the hatching."""
    plt = _pyplot()
    shown, why = _units_step(run_data)
    fig, axes = plt.subplots(
        len(run_data),
        1,
        figsize=(11, 1.4 + 0.5 * _max_ranks(run_data) * len(run_data)),
        squeeze=False,
        layout="constrained",
    )
    for ax, (name, (ranks, _)) in zip(axes[:, 0], run_data.items(), strict=True):
        recs = [x for x in ranks if x["step"] == shown[name]]
        draw_timeline(ax, record_bars(recs), max(r["rank"] for r in ranks) + 1, f"{name}, step {shown[name]}")
    right = max(ax.get_xlim()[1] for ax in axes[:, 0])
    for ax in axes[:, 0]:
        ax.set_xlim(0, right)
    fig.suptitle(f"units per rank, {why}", fontsize=9)
    return fig


def step_times_figure(run_data: RunData):
    """``step_times.png``: the distribution of each run's step times (warm-up step left out)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    ax.boxplot([[s["step_seconds"] for s in st[1:] or st] for _, st in run_data.values()])
    ax.set_xticks(range(1, len(run_data) + 1), list(run_data))
    ax.set(title="step time per run (box: quartiles, line: median)", ylabel="seconds per step")
    return fig


def budget_density_figure(run_data: RunData):
    """``budget_density.png``: each rank's budget (left) and realized attention density
    (right) per step; one legend, beside the right panel, for the lines of both."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11.5, 3.5), layout="constrained")
    for i, (name, (ranks, _)) in enumerate(run_data.items()):
        for r in sorted({x["rank"] for x in ranks}):
            recs = [x for x in ranks if x["rank"] == r]
            style = {"ls": "-" if i == 0 else "--", "label": f"{name}, rank {r}"}
            axes[0].plot(
                [x["step"] for x in recs],
                [x.get("budget_mean", x.get("gamma_mean")) for x in recs],  # gamma_*: old
                **style,
            )
            axes[1].plot([x["step"] for x in recs], [x["density"] for x in recs], **style)
    kinds = {st[-1].get("budget_kind") or "" for _, st in run_data.values()}
    unit = "k (top-k)" if kinds == {"top-k"} else "gamma" if kinds == {"gamma"} else "k or gamma"
    axes[0].set(title="budget per rank (mean over layers)", xlabel="step", ylabel=unit)
    axes[1].set(
        title="realized attention density per rank", xlabel="step", ylabel="density (kept / causal block pairs)"
    )
    for ax in axes:
        _integer_steps(ax)
    axes[1].legend(
        loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize=7, title="both panels", title_fontsize=7
    )
    return fig


def loss_figure(run_data: RunData):
    """``loss.png``: each run's training loss per step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    for name, (_, steps) in run_data.items():
        ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], label=name)
    ax.set(title="training loss", xlabel="step", ylabel="loss")
    _integer_steps(ax)
    ax.legend()
    return fig


PLOTS = {
    "timeline.png": timeline_figure,
    "units.png": units_figure,
    "step_times.png": step_times_figure,
    "budget_density.png": budget_density_figure,
    "loss.png": loss_figure,
}
"""The report's figures, in the order ``report.md`` shows them."""


def _plots(run_data: RunData, out_dir: Path) -> list[str]:
    made = [_save(make(run_data), out_dir / name) for name, make in PLOTS.items()]
    if any(pipeline_line(ranks) for ranks, _ in run_data.values()):  # --pp: the stages' bubbles
        made.append(_save(pipeline_figure(run_data), out_dir / "pipeline.png"))
    return made


def _max_ranks(run_data: RunData) -> int:
    return max(max(r["rank"] for r in ranks) + 1 for ranks, _ in run_data.values())


def _save(fig, path: Path) -> str:
    plt = _pyplot()
    try:
        write_file(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path.name


def write_report(root: Path, plots: bool = True, out: Path | None = None) -> tuple[Path, dict]:
    """Write ``report.md`` (and PNGs) into ``out`` (default: ``root``, the run folder); returns
    its path and the comparison.

    Each file is written atomically and replaces the one of an earlier report of this run (they
    are made from its ``metrics.jsonl`` again at will); a full disk raises
    :class:`~sparsebalance.results.DiskFull` with the earlier file intact."""
    root = Path(root)
    out = root if out is None else Path(out)
    runs = find_runs(root)
    out.mkdir(parents=True, exist_ok=True)
    data = {name: load_run(path) for name, path in runs.items()}
    table, comparison = comparison_table({n: run_summary(ranks, st) for n, (ranks, st) in data.items()})
    lines = [f"# Training report: {root}", "", table, "", table_note(comparison), ""]
    lines += [x for line in verdict_lines(root, data) for x in (line, "")]  # the demo's
    for name, (_, steps) in data.items():
        line = long_documents(steps)
        if line:
            lines += [f"Long documents, {name}: {line}", ""]
    for name, (ranks, steps) in data.items():
        line = budgets(ranks, steps)
        if line:
            lines += [f"Budgets, {name}: {line}", ""]
        line = dst_line(steps)
        if line:
            lines += [f"DST, {name}: {line}", ""]
        line = pipeline_line(ranks)
        if line:
            lines += [f"Pipeline, {name}: {line}", ""]
    if plots:
        try:
            for f in _plots(data, out):
                lines.append(f"![{f}]({f})")
        except ImportError:
            lines.append("(plots skipped: `pip install matplotlib`, or the `plot` extra)")
    # atomic, and replaced: the run's own report, made again from its metrics.jsonl at will
    path = write_file(out / "report.md", "\n".join(lines) + "\n")
    write_file(out / "comparison.json", json.dumps(comparison, indent=1) + "\n")
    return path, comparison
