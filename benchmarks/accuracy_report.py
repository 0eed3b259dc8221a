"""Tables, paired-by-seed tests and heatmaps for ``benchmarks/accuracy.py``'s records."""

from __future__ import annotations

import math
import statistics
import subprocess
from pathlib import Path

import torch

from sparsebalance.results import markdown_table, write_results

TASKS = ("passkey", "niah1", "mqar")

VARIANT_NOTES = {
    "dense": "SAB batching, every block (gamma 1.0)",
    "fixed-0.9": "token-balanced batching (no SAB), fixed gamma 0.9, no DST",
    "fixed-low": "token-balanced batching, the lower fixed gamma (where selection misses)",
    "sab": "SAB batching alone, fixed gamma 0.9, no DST",
    "dst-bidir-mean": "SAB + DST bidirectional, mean anchor, p = tolerance",
    "dst-down-mean": "SAB + DST down-only (stragglers cut, nobody raised), mean anchor",
    "dst-bidir-min": "SAB + DST bidirectional, min anchor",
}


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p-value of Student's t with integer ``df`` (Abramowitz & Stegun 26.7.3-4)."""
    if df < 1:
        return float("nan")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd
        total, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):
            if k > 1:
                term *= c2 * (2 * k - 2) / (2 * k - 1)
            total += term
        a = 2 / math.pi * (theta + math.sin(theta) * total) if df > 1 else 2 * theta / math.pi
    else:
        total, term = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        a = math.sin(theta) * total
    return max(0.0, min(1.0, 1.0 - a))


def paired(a: list[float], b: list[float]) -> dict:
    """Paired comparison of ``a - b`` over seeds: mean, std, wins/losses/ties, t-test p."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = statistics.mean(d)
    sd = statistics.stdev(d) if n > 1 else float("nan")
    if n > 1 and sd > 0:
        p = t_two_sided_p(mean / (sd / math.sqrt(n)), n - 1)
    else:
        p = float("nan") if mean == 0 or n < 2 else 0.0
    wins = sum(x > 1e-12 for x in d)
    losses = sum(x < -1e-12 for x in d)
    return {
        "mean": mean,
        "std": sd,
        "wins": wins,
        "losses": losses,
        "ties": n - wins - losses,
        "p": p,
        "n": n,
    }


def ms(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "-"
    if len(xs) < 2:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def mean_em(ev: dict) -> float:
    return sum(ev[t]["exact"] for t in TASKS) / len(TASKS)


def tables(payload: dict) -> str:
    records, names = payload["records"], payload["args"]["variants"]
    by = {
        v: sorted((r for r in records if r["variant"] == v), key=lambda r: r["seed"]) for v in names
    }
    out = ["## Pretrained checkpoint (before continuation), evaluated at fixed budgets", ""]
    rows = []
    for g, ev in payload["pretrained"].items():
        rows.append(
            [g, f"{ev['eval_density']:.3f}"]
            + [f"{ev[t]['exact']:.2f}" for t in TASKS]
            + [f"{ev['ppl']:.3f}"]
            + [" / ".join(f"{x:.3f}" for x in ev["recall"].values())]
        )
    out.append(
        markdown_table(
            ["gamma", "density", *[f"{t} EM" for t in TASKS], "ppl", "recall per layer"], rows
        )
    )
    out += ["", "## Continuation training (mean ± std over seeds)", ""]
    rows = []
    for v in names:
        rs = by[v]
        rows.append(
            [
                v,
                len(rs),
                ms([r["train_density"] for r in rs]),
                ms([r["predicted_step_s"] for r in rs], 4),
                ms([r["step_s"] for r in rs]),
                ms([r["efficiency"] for r in rs]),
                ms([r["final_loss"] for r in rs]),
            ]
        )
    out.append(
        markdown_table(
            [
                "variant",
                "seeds",
                "trained density",
                "predicted s / step (cost)",
                "measured s / step",
                "balance eff.",
                "loss (last 5)",
            ],
            rows,
        )
    )
    for setting, title in (
        ("dense", "dense attention (gamma 1.0)"),
        (
            "own",
            "each variant's own budget (its gamma0; DST variants at "
            "gamma0, the budget their planner starts from)",
        ),
    ):
        out += ["", f"## Evaluation with {title}", ""]
        rows = []
        for v in names:
            evs = [r["eval"][setting] for r in by[v]]
            rows.append(
                [v, ms([mean_em(e) for e in evs])]
                + [ms([e[t]["exact"] for e in evs], 2) for t in TASKS]
                + [ms([e[t]["token_acc"] for e in evs], 2) for t in TASKS]
                + [ms([e["ppl"] for e in evs]), ms([e["eval_density"] for e in evs])]
                + [" / ".join(ms([float(e["recall"][k]) for e in evs]) for k in evs[0]["recall"])]
            )
        out.append(
            markdown_table(
                [
                    "variant",
                    "mean EM",
                    *[f"{t} EM" for t in TASKS],
                    *[f"{t} tok acc" for t in TASKS],
                    "ppl",
                    "eval density",
                    "recall per layer",
                ],
                rows,
            )
        )
        lengths = list(by[names[0]][0]["eval"][setting][TASKS[0]]["by_length"])
        head = ["variant"] + [f"{t} {n}" for t in TASKS for n in lengths]
        rows = [
            [v]
            + [
                ms([r["eval"][setting][t]["by_length"][n] for r in by[v]], 2)
                for t in TASKS
                for n in lengths
            ]
            for v in names
        ]
        out += ["", "Exact match by prompt length:", "", markdown_table(head, rows)]
    metrics = (
        ("mean EM", lambda e: mean_em(e)),
        ("mean tok acc", lambda e: sum(e[t]["token_acc"] for t in TASKS) / len(TASKS)),
        ("ppl", lambda e: e["ppl"]),
    )
    out += ["", "## Paired by seed (own budget; mean over the three tasks)", ""]
    rows = []
    for ref in ("fixed-0.9", "dense"):
        if ref not in by:
            continue
        for v in names:
            if v == ref:
                continue
            cost = statistics.mean(r["predicted_step_s"] for r in by[v])
            cost_ref = statistics.mean(r["predicted_step_s"] for r in by[ref])
            row = [f"{v} - {ref}", f"{cost / cost_ref:.3f}"]
            for _, fn in metrics:
                c = paired(
                    [fn(r["eval"]["own"]) for r in by[v]], [fn(r["eval"]["own"]) for r in by[ref]]
                )
                row.append(
                    f"{c['mean']:+.3f} ± {c['std']:.3f} ({c['wins']}/{c['losses']}/"
                    f"{c['ties']}, p {c['p']:.2f})"
                )
            rows.append(row)
    head = ["difference", "cost ratio (predicted s/step)"]
    head += [f"Δ {name} (± std; seeds +/-/=, paired t p)" for name, _ in metrics]
    out.append(markdown_table(head, rows))
    return "\n".join(out)


def heatmaps(payload: dict, path: Path) -> Path | None:
    """One PNG: exact match by length (x) and needle depth (y), own budget, mean over seeds;
    a row per variant, a column per task."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return None
    names = payload["args"]["variants"]
    fig, axes = plt.subplots(
        len(names), len(TASKS), figsize=(3.2 * len(TASKS), 1.9 * len(names)), squeeze=False
    )
    for i, v in enumerate(names):
        recs = [r for r in payload["records"] if r["variant"] == v]
        for j, t in enumerate(TASKS):
            grid = recs[0]["eval"]["own"][t]["grid"]
            lengths = list(grid)
            depths = sorted({d for row in grid.values() for d in row}, key=float)
            acc = np.array(
                [
                    [np.mean([r["eval"]["own"][t]["grid"][n][d] for r in recs]) for n in lengths]
                    for d in depths
                ]
            )
            ax = axes[i][j]
            ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(lengths)), lengths, fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{float(d):.0%}" for d in depths], fontsize=7)
            for a in range(len(depths)):
                for b in range(len(lengths)):
                    ax.text(b, a, f"{acc[a, b]:.2f}", ha="center", va="center", fontsize=7)
            ax.set_title(f"{v}: {t}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(payload: dict, args, argv) -> Path:
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    payload["uptime_at_end"] = load
    table = tables(payload)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import datetime as dt

    png = heatmaps(payload, out / f"{dt.date.today().isoformat()}-{args.name}-heatmaps.png")
    notes = (
        f"Wall {payload['wall_s']:.0f} s; load at the end: `{load}` (a shared 2-core machine with "
        "other engineers' jobs running; this run used one torch thread at normal priority). "
        f"Seeds 0..{args.seeds - 1}; ± is the sample std over seeds. EM = teacher-forced exact "
        f"match of the whole answer; {args.eval_examples} held-out examples per task, length and "
        "depth (eval split: keys and values never trained on). Cost = the planner's predicted "
        "step time (slowest emulated rank, latency model), the same on any machine; measured "
        "s/step is wall time on the loaded CPU. p-values of a paired t-test over "
        f"{args.seeds} seeds are weak evidence (df = {args.seeds - 1}; a sign test over 3 seeds "
        "can never reach p < 0.05). Continuation data: "
        + ", ".join(f"{k} {v}" for k, v in payload["task_counts"].items())
        + (f". Heatmaps: `{png.name}`." if png else ".")
    )
    md, _ = write_results(out, args.name, torch.device("cpu"), table, payload, notes)
    return md


def main(argv=None) -> int:
    """Re-render a results file from its JSON: ``accuracy_report.py RESULTS.json``."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("json")
    args = p.parse_args(argv)
    payload = json.loads(Path(args.json).read_text())
    print(tables(payload))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
