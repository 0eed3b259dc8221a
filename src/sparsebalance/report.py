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

from .results import markdown_table
from .timeline import draw_timeline, record_bars


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


def comparison_table(
    runs: dict[str, dict], baseline: str | None = None, predicted: dict[str, dict] | None = None
) -> tuple[str, dict]:
    """The ablation table (``report``, ``train --demo``, ``bench-e2e``): markdown and JSON-ready.

    Args:
        runs: run name -> :func:`summarize` of its steps.
        baseline: the run speed-ups are measured against (default ``baseline``, else the first).
        predicted: run name -> the simulator's summary of the same strategy (``step_seconds``,
            ``speedup``, ``mean_density``); adds the predicted speed-up and the prediction's error
            against the measured slowest-rank compute time.
    """
    base = runs.get(baseline or "baseline") or next(iter(runs.values()))
    headers = ["run", "steps", "mean step (s)", "speedup", "compute speedup", "balance eff.",
               "bubble frac.", "mean density", "final loss"]  # fmt: skip
    if predicted is not None:
        headers += ["predicted speedup", "prediction error (step)"]
    rows, out = [], {}
    for name, s in runs.items():
        entry = {
            **s,
            "speedup": base["mean_step_s"] / s["mean_step_s"],
            "compute_speedup": base["mean_max_compute_s"] / s["mean_max_compute_s"],
        }
        rows.append([name, s["steps"], s["mean_step_s"], entry["speedup"],
                     entry["compute_speedup"], s["efficiency"], s["bubble_fraction"],
                     s["mean_density"], s["final_loss"]])  # fmt: skip
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
    return (
        f"{kind}, per-rank budgets {unit}{fmt.format(min(values))} .. {fmt.format(max(values))} "
        f"(mean over layers; up to {fmt.format(spread)} apart within a step), realized density "
        f"{float(np.mean([s['mean_density'] for s in body])):.2f}, coverage bound stopped "
        f"{limited} layer cut{'s' if limited != 1 else ''}; planning + DST {1e3 * overhead:.1f} ms "
        f"a step ({100 * share:.2f} % of it)."
    )


def _plots(run_data: dict[str, tuple[list[dict], list[dict]]], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, axes = plt.subplots(1, len(run_data), figsize=(6 * len(run_data), 3.5), squeeze=False)
    for ax, (name, (ranks, _)) in zip(axes[0], run_data.items(), strict=True):
        nr = max(r["rank"] for r in ranks) + 1
        for r in range(nr):
            recs = [x for x in ranks if x["rank"] == r]
            x = np.array([x["step"] for x in recs]) + (r - (nr - 1) / 2) * 0.8 / nr
            comp = np.array([x["compute_s"] for x in recs])
            bub = np.array([x["derived_bubble_s"] for x in recs])
            ax.bar(x, comp, width=0.8 / nr, color=f"C{r}", label=f"rank {r} compute")
            ax.bar(
                x,
                bub,
                bottom=comp,
                width=0.8 / nr,
                color=f"C{r}",
                alpha=0.3,
                hatch="//",
                label=f"rank {r} bubble",
            )
        ax.set(title=f"{name}: compute vs bubble", xlabel="step", ylabel="seconds")
        ax.legend(fontsize=7)
    files.append(_save(fig, out_dir / "timeline.png"))
    fig, axes = plt.subplots(len(run_data), 1, figsize=(9, 1.2 + 0.5 * _max_ranks(run_data)
                             * len(run_data)), squeeze=False)  # fmt: skip
    for ax, (name, (ranks, steps)) in zip(axes[:, 0], run_data.items(), strict=True):
        # the last step that ran a CP unit (the point of the plot), else the last step
        cp = [x["step"] for x in ranks if any(u["degree"] > 1 for u in x.get("units", ()))]
        step = max(cp) if cp else steps[-1]["step"]
        recs = [x for x in ranks if x["step"] == step]
        draw_timeline(
            ax,
            record_bars(recs),
            max(r["rank"] for r in ranks) + 1,
            f"{name}, step {step}: units per rank (a bar over several ranks: one CP unit; "
            "hatched: waiting for its last rank)",
        )
    files.append(_save(fig, out_dir / "units.png"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.boxplot([[s["step_seconds"] for s in st[1:] or st] for _, st in run_data.values()])
    ax.set_xticks(range(1, len(run_data) + 1), list(run_data))
    ax.set(title="step time per run", ylabel="seconds")
    files.append(_save(fig, out_dir / "step_times.png"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for i, (name, (ranks, _)) in enumerate(run_data.items()):
        for r in sorted({x["rank"] for x in ranks}):
            recs = [x for x in ranks if x["rank"] == r]
            axes[0].plot(
                [x["step"] for x in recs],
                [x.get("budget_mean", x.get("gamma_mean")) for x in recs],  # gamma_*: old runs
                ls="-" if i == 0 else "--",
                label=f"{name} r{r}",
            )
            axes[1].plot(
                [x["step"] for x in recs],
                [x["density"] for x in recs],
                ls="-" if i == 0 else "--",
                label=f"{name} r{r}",
            )
    axes[0].set(title="budget per rank (k or gamma, mean over layers)", xlabel="step")
    axes[1].set(title="realized density per rank", xlabel="step")
    axes[0].legend(fontsize=7)
    files.append(_save(fig, out_dir / "budget_density.png"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, (_, steps) in run_data.items():
        ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], label=name)
    ax.set(title="training loss", xlabel="step", ylabel="loss")
    ax.legend()
    files.append(_save(fig, out_dir / "loss.png"))
    return files


def _max_ranks(run_data) -> int:
    return max(max(r["rank"] for r in ranks) + 1 for ranks, _ in run_data.values())


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def write_report(root: Path, plots: bool = True) -> tuple[Path, dict]:
    """Write ``report.md`` (and PNGs) into ``root``; returns its path and the comparison."""
    root = Path(root)
    runs = find_runs(root)
    data = {name: load_run(path) for name, path in runs.items()}
    table, comparison = comparison_table({n: summarize(st) for n, (_, st) in data.items()})
    note = (
        "Means over steps 2..N (step 1 is warm-up). Speedup = baseline mean step time / run's; "
        "compute speedup uses the slowest rank's compute time. Balance efficiency = mean / max "
        "rank compute time; bubble fraction = 1 - efficiency."
    )
    lines = [f"# Training report: {root}", "", table, "", note, ""]
    for name, (_, steps) in data.items():
        line = long_documents(steps)
        if line:
            lines += [f"Long documents, {name}: {line}", ""]
    for name, (ranks, steps) in data.items():
        line = budgets(ranks, steps)
        if line:
            lines += [f"Budgets, {name}: {line}", ""]
    if plots:
        try:
            for f in _plots(data, root):
                lines.append(f"![{f}]({f})")
        except ImportError:
            lines.append("(plots skipped: `pip install matplotlib`, or the `plot` extra)")
    path = root / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (root / "comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")
    return path, comparison
