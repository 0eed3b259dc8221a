"""Tables, paired-by-seed comparisons (:mod:`accuracy_stats`), the paper's figures beside ours,
and plots for ``benchmarks/accuracy.py``'s records. ``python benchmarks/accuracy_report.py
RESULTS.json`` re-renders the tables of a results file."""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

import torch

from accuracy_stats import min_p, paired
from sparsebalance.results import markdown_table, write_results

TASKS = ("passkey", "niah1", "mqar")
SETTINGS = {
    "dense": "dense attention",
    "base": "the variant's base budget (K; K/2 for fixed-K/2; gamma 0.9 for gamma-rule)",
    "final": "the final per-length-bin k of the run (DST top-k variants; others = base)",
}

# (A, B, setting, H1 of the one-sided test on A - B, what it asks)
COMPARISONS = (
    ("fixed-K/2", "fixed-K", "base", "less", "harm of halving K (each at its own budget)"),
    ("fixed-K/2", "fixed-K", "dense", "less", "does training at K/2 hurt the dense model"),
    ("dst-mean-p0.1", "fixed-K", "base", "less", "DST Mean p=0.1 vs fixed K, evaluated at K"),
    ("dst-mean-p0.1", "fixed-K", "final", "less", "... evaluated at the final per-bin k"),
    ("dst-mean-p0.2", "dst-mean-p0.1", "final", "less", "paper: p = 0.2 loses a little"),
    ("dst-min-p0.1", "dst-mean-p0.1", "final", "less", "paper: Min loses a little vs Mean"),
    ("dst-mean-p0.2", "dst-mean-p0.1", "base", "less", "p = 0.2 vs 0.1 at the same budget K"),
    ("dst-min-p0.1", "dst-mean-p0.1", "base", "less", "Min vs Mean at the same budget K"),
    ("sab-dst-mean-p0.1", "fixed-K", "final", "less", "SAB + DST Mean p=0.1 vs fixed K"),
    ("sab-dst-mean-p0.1", "dst-mean-p0.1", "final", "less", "adding SAB to DST"),
    ("dst-mean-p0.2", "fixed-K", "final", "less", "DST Mean p=0.2 vs fixed K"),
    ("dst-min-p0.1", "fixed-K", "final", "less", "DST Min p=0.1 vs fixed K"),
    ("gamma-rule", "fixed-K", "base", "less", "today's gamma rule (gamma 0.9) vs fixed K"),
)

# As quoted in issue 29 (the SparseBalance paper, Qwen2.5-3B).
PAPER = {
    ("dst-mean-p0.1", "fixed-K"): "LongBench overall 39.46 vs 39.28; NIAH 64K 97.53 vs 97.60",
    ("dst-min-p0.1", "dst-mean-p0.1"): "NIAH 64K: Min p=0.1 96.33 vs Mean p=0.1 97.53",
    ("dst-mean-p0.2", "dst-mean-p0.1"): "'slightly higher loss' at p = 0.2 (no figure quoted)",
}


def ms(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "-"
    if len(xs) < 2:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def by_variant(payload: dict) -> dict[str, list[dict]]:
    recs = payload["records"]
    return {
        v: sorted((r for r in recs if r["variant"] == v), key=lambda r: r["seed"]) for v in payload["args"]["variants"]
    }


def pretrained_tables(payload: dict) -> list[str]:
    base = payload["pretrained"]
    rows = []
    for name, ev in base["test"].items():
        rows.append(
            [name, f"{ev['eval_density']:.3f}", f"{ev['mean_em']:.3f}"]
            + [f"{ev[t]['by_length'][n]:.2f}" for t in TASKS for n in ev[t]["by_length"]]
            + [f"{ev['ppl']:.3f}", " / ".join(f"{x:.3f}" for x in ev["recall"].values())]
        )
    first = next(iter(base["test"].values()))
    head = ["setting", "eval density", "mean EM"]
    head += [f"{t} {n}" for t in TASKS for n in first[t]["by_length"]]
    out = ["## Pretrained checkpoint (test examples)", "", markdown_table([*head, "ppl", "recall per layer"], rows)]
    rows = [
        [k, f"{e['density']:.3f}", f"{e['mean_em']:.3f}"] + [f"{e[t][n]:.2f}" for t in TASKS for n in e[t]]
        for k, e in base["dev_sweep"].items()
    ]
    first = next(iter(base["dev_sweep"].values()))
    out += [
        "",
        "Dev sweep of k on the pretrained checkpoint (dev examples; what K was chosen from):",
        "",
        markdown_table(["k", "eval density", "mean EM"] + [f"{t} {n}" for t in TASKS for n in first[t]], rows),
    ]
    return out


def training_table(by: dict[str, list[dict]], payload: dict) -> list[str]:
    rows = []
    for v, rs in by.items():
        tr = [r["train"] for r in rs]
        roles = {k: sum(t["roles"].get(k, 0) for t in tr) for k in ("cut", "raised", "kept")}
        rows.append(
            [
                v,
                payload["dst"][v],
                len(rs),
                ms([t["density"] for t in tr]),
                ms([t["predicted_step_s"] for t in tr], 4),
                ms([t["predicted_efficiency"] for t in tr]),
                f"{roles['cut']}/{roles['raised']}/{roles['kept']}",
                f"{min(t['budget_min'] for t in tr):g} / {ms([t['budget_mean'] for t in tr], 2)} / "
                f"{max(t['budget_max'] for t in tr):g}",
                ms([t["units_cut"] for t in tr], 2),
                ms([t["units_raised"] for t in tr], 2),
                sum(t["coverage_limited"] for t in tr),
                ms([statistics.mean(t["losses"][-5:]) for t in tr]),
                " ".join(str(r["chosen_step"]) for r in rs),
            ]
        )
    head = [
        "variant",
        "DST",
        "seeds",
        "trained density (len²-weighted)",
        "predicted s / step (slowest rank)",
        "predicted balance",
        "roles cut/raised/kept",
        "budget min / mean / max",
        "share of ranks cut",
        "share raised",
        "coverage-bound stops",
        "loss (last 5)",
        "chosen step per seed",
    ]
    return ["", "## Continuation training (mean ± std over seeds)", "", markdown_table(head, rows)]


def eval_tables(by: dict[str, list[dict]]) -> list[str]:
    out = []
    for setting, title in SETTINGS.items():
        rows = []
        for v, rs in by.items():
            evs = [r["eval"][setting] for r in rs]
            lengths = list(evs[0][TASKS[0]]["by_length"])
            rows.append(
                [v, ms([e["mean_em"] for e in evs])]
                + [ms([e[t]["by_length"][n] for e in evs], 2) for t in TASKS for n in lengths]
                + [ms([e["eval_density"] for e in evs]), ms([e["ppl"] for e in evs])]
                + [" / ".join(ms([float(e["recall"][k]) for e in evs]) for k in evs[0]["recall"])]
            )
        head = ["variant", "mean EM"] + [f"{t} {n}" for t in TASKS for n in lengths]
        head += ["eval density", "ppl", "recall per layer"]
        out += ["", f"## Evaluation at {title}", "", markdown_table(head, rows)]
    return out


def comparisons(by: dict[str, list[dict]]) -> tuple[list[str], list[dict]]:
    rows, found = [], []
    for a, b, setting, alt, question in COMPARISONS:
        if a not in by or b not in by:
            continue
        ra, rb = by[a], by[b]
        if [r["seed"] for r in ra] != [r["seed"] for r in rb]:
            continue
        c = paired([r["eval"][setting]["mean_em"] for r in ra], [r["eval"][setting]["mean_em"] for r in rb], alt)
        cost = statistics.mean(r["train"]["predicted_step_s"] for r in ra) / statistics.mean(
            r["train"]["predicted_step_s"] for r in rb
        )
        found.append({"a": a, "b": b, "setting": setting, **c})
        lo, hi = c["ci95"]
        rows.append(
            [
                f"{a} - {b}",
                setting,
                question,
                f"{c['mean']:+.3f}",
                f"[{lo:+.3f}, {hi:+.3f}]",
                f"{c['wins']}/{c['losses']}/{c['ties']}",
                f"{c['p_perm']:.3f}",
                f"{c['p_perm_two_sided']:.3f}",
                f"{c['p_t']:.3f}",
                f"{cost:.3f}",
                PAPER.get((a, b), ""),
            ]
        )
    head = [
        "difference (mean EM)",
        "evaluated at",
        "question",
        "Δ",
        "95 % t-interval",
        "seeds +/-/=",
        "one-sided sign-flip p (H1: Δ < 0)",
        "sign-flip p (2-sided)",
        "paired t p (2-sided)",
        "cost ratio (predicted s/step)",
        "the paper (as quoted in issue 29)",
    ]
    return ["", "## Paired by seed (ours beside the paper's figures)", "", markdown_table(head, rows)], found


def continuation_table(by: dict[str, list[dict]], payload: dict) -> list[str]:
    base = payload["pretrained"]["test"]["dense"]["mean_em"]
    rows = []
    for v, rs in by.items():
        em = [r["eval"]["dense"]["mean_em"] for r in rs]
        rows.append(
            [
                v,
                f"{base:.3f}",
                ms(em),
                f"{statistics.mean(em) - base:+.3f}",
                f"{min(em) - base:+.3f}",
                "yes" if min(em) >= base - 0.05 else "no",
            ]
        )
    head = ["variant", "pretrained dense EM", "continued dense EM", "Δ mean", "Δ worst seed", "every seed within 0.05"]
    return ["", "## Continuation vs the pretrained model (dense evaluation)", "", markdown_table(head, rows)]


def tables(payload: dict) -> tuple[str, list[dict]]:
    by = by_variant(payload)
    out = pretrained_tables(payload) + training_table(by, payload) + eval_tables(by)
    cmp_lines, found = comparisons(by)
    out += continuation_table(by, payload) + cmp_lines
    return "\n".join(out), found


def plot(payload: dict, path: Path) -> Path | None:
    """One PNG: mean EM per variant and setting (bars: mean over seeds, dots: seeds); recall per
    layer at the final budget; the pretrained model's dev EM against k."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    by = by_variant(payload)
    names = list(by)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    ax = axes[0]
    for j, setting in enumerate(SETTINGS):
        for i, v in enumerate(names):
            ys = [r["eval"][setting]["mean_em"] for r in by[v]]
            x = i + (j - 1) * 0.27
            ax.bar(x, statistics.mean(ys), 0.25, color=f"C{j}", label=setting if i == 0 else None)
            ax.scatter([x] * len(ys), ys, s=8, color="k", zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("mean exact match (3 tasks, 2 lengths)")
    ax.legend(fontsize=8)
    ax.set_title("exact match per variant (dots: seeds)")
    ax = axes[1]
    for i, v in enumerate(names):
        rec = by[v][0]["eval"]["final"]["recall"]
        layers = list(rec)
        ys = [statistics.mean(float(r["eval"]["final"]["recall"][k]) for r in by[v]) for k in layers]
        ax.plot([int(k) for k in layers], ys, marker="o", label=v, color=f"C{i}")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention recall at the final budget")
    ax.legend(fontsize=7)
    ax = axes[2]
    sweep = payload["pretrained"]["dev_sweep"]
    ax.plot([int(k) for k in sweep], [e["mean_em"] for e in sweep.values()], marker="o")
    ax.set_xscale("log", base=2)
    ax.axvline(payload["args"]["k_base"], color="grey", ls="--", label="K")
    ax.set_xlabel("top-k k (blocks)")
    ax.set_ylabel("pretrained mean EM (dev)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _wall_note(payload: dict) -> str:
    """The wall time, and how much of the grid it covers: with --records, a grid may be shared by
    two processes or resumed, and this process's wall is then not the grid's."""
    recs = payload["records"]
    total, here = len(recs), payload.get("runs_here", len(recs))
    note = f"Wall {payload['wall_s']:.0f} s"
    if here != total:
        note += (
            f" for the {here} of {total} runs this process ran (and the baseline); the others "
            "were read from --records (another process sharing the grid, or an earlier invocation)"
        )
    if all("run_wall_s" in r for r in recs):  # records written since 2026-11-25
        note += f"; the runs took {sum(r['run_wall_s'] for r in recs):.0f} s in all"
    return note


def write_report(payload: dict, args, argv) -> Path:
    import datetime as dt

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    payload["uptime_at_end"] = load
    table, found = tables(payload)
    payload["comparisons"] = found
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(payload, out / f"{dt.date.today().isoformat()}-{args.name}.png")
    n = args.seeds
    notes = (
        f"{_wall_note(payload)}; load at the end: `{load}`. Seeds 0..{n - 1} (training "
        "seeds: data order and initialisation of the continuation; identical across variants). "
        f"EM = teacher-forced exact match; {args.eval_examples} test examples per task and "
        f"length ({len(args.eval_lengths)} lengths, 5 needle depths), eval split (keys and "
        f"values never trained on), test seed disjoint from the dev seed that chose each run's "
        f"checkpoint ({args.candidates} candidates, {args.dev_examples} dev examples per task and "
        "length). 'Predicted s / step' = the latency model's time of the slowest emulated rank "
        "(DST runs in deterministic mode: budgets from predicted times, so they do not depend on "
        "this machine's load). One-sided sign-flip p is exact over the 2^n sign patterns; its "
        f"smallest value with {n} seeds is {min_p(n):.3f}. "
        f"Continuation data: {payload['task_counts']}." + (f" Plot: `{png.name}`." if png else "")
    )
    md, _ = write_results(out, args.name, torch.device("cpu"), table, payload, notes)
    return md


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Re-render an accuracy results file's tables")
    p.add_argument("json")
    args = p.parse_args(argv)
    print(tables(json.loads(Path(args.json).read_text()))[0])
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
