"""Is the latency model's per-rank prediction error systematic? (issue 56: DST predicts a balance
near 0.99, the ranks measure 0.94-0.95.) Reads the per-rank records of ``benchmarks/dst_gain.py``
results files and writes nothing but a report; no wall clock, no training.

    .venv/bin/python benchmarks/latency_residuals.py benchmarks/results/2026-12-02-dst-gain-*.json
    .venv/bin/python benchmarks/latency_residuals.py FILES --out benchmarks/results/NAME.md

What the files hold, per run (SAB, SAB+DST), seed, step and rank (the JSON's ``per_rank``; files
without it are skipped): measured compute seconds, the prediction DST acted on (``predicted_s``,
the recalibrated model at the planned budgets), its prediction before DST (``predicted_before_s``),
the run's profile (uncalibrated) and the true profile pricing the realised budgets (``realised_s``,
``truth_s``), the DST role, the per-layer controller's seconds and the coverage-limited count. No
per-micro-batch record (lengths, documents, budgets) is kept, so the document-level features
(documents per pack, tokens, sum of squared lengths, a micro-batch's position) cannot be tested
here. Derived per rank-step:

- the residual ``log(measured / predicted)`` minus the step's median over ranks (a load change
  between steps hits every rank of the step alike and is removed; what is left is what spreads
  the ranks, the balance gap), against ``predicted_s`` (``rp``) and against ``truth_s`` (``rt``);
- the attention share of the true profile's price, from the two prices and the run's
  ``--attention-skew`` s: ``realised = s A + R``, ``truth = A + R`` (runs with s = 1 have no share);
- the size (log ``truth_s`` minus the step's mean), the rank's index in the emulated order, DST's
  change of the rank's predicted time (log ``predicted_s / predicted_before_s``: > 0 raised), the
  controller's share of the rank's time, whether the run went first in its step pair.

Sections: one-feature correlations and slopes and a joint least squares per run kind and skew;
how much of the residual repeats when the same work is measured again (SAB's plans and budgets
are identical across files of one skew and seed: same ``truth_s``), which bounds what any model
can fix; the held-out check (fit level and split, then a level and split plus each candidate
feature, on earlier steps or on one file, score later steps or another file); and the online
filter (:class:`~sparsebalance.latency.calibration.ScaleFilter`) replayed over the ranks in the
order they ran, with the prediction error it leaves on the steps it had not yet seen.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np

from sparsebalance.latency import load_profile
from sparsebalance.latency.calibration import SPLIT_DRIFT, SPLIT_STD, ScaleFilter
from sparsebalance.latency.model import measurement_noise
from sparsebalance.results import markdown_table

BURST = float(np.log(1.5))
"""Rank-steps whose residual is beyond this (a 1.5x load burst, as ``dst_gain.BURST``) are left out."""
DISTURBED = ("2026-12-02-dst-gain-median-attention-x2-cpu.json",)
"""Files docs/benchmarks.md marks as measured under load (the author ran tests meanwhile)."""


def load(paths: list[str]) -> list[dict]:
    """One row per rank-step of every file with per-rank records."""
    rows = []
    for path in paths:
        if Path(path).name in DISTURBED:
            print(f"skipped {path}: measured under load (docs/benchmarks.md)", file=sys.stderr)
            continue
        d = json.loads(Path(path).read_text())
        match = re.search(r"--attention-skew (\S+)", d["command"])
        skew = float(match.group(1)) if match else 1.0
        profile = re.search(r"--profile (\S+)", d["command"])
        for mix, row in d["rows"].items():
            for seed, runs in row.get("per_rank", {}).items():
                for run, steps in runs.items():
                    for i, step in enumerate(steps):
                        rows += rank_rows(step, Path(path).stem, mix, int(seed), run, i, skew)
                        for r in rows[-len(step) :]:
                            r["profile"] = profile.group(1) if profile else None
    return rows


def rank_rows(step: list[dict], file: str, mix: str, seed: int, run: str, i: int, skew: float) -> list[dict]:
    comp = np.array([r["compute_s"] for r in step])
    pred = np.array([r["predicted_s"] for r in step])
    truth = np.array([r["truth_s"] for r in step])
    rp, rt = np.log(comp / pred), np.log(comp / truth)
    out = []
    for k, r in enumerate(step):
        att = (r["realised_s"] - r["truth_s"]) / (skew - 1.0) if skew != 1.0 else float("nan")
        out.append(
            {
                "file": file.removeprefix("2026-12-02-dst-gain-"),
                "mix": mix,
                "seed": seed,
                "run": run,
                "step": i,
                "rank": k,
                "skew": skew,
                "compute": r["compute_s"],
                "truth": r["truth_s"],
                "realised": r["realised_s"],
                "att": att,
                "rp": float(rp[k] - np.median(rp)),
                "rt": float(rt[k] - np.median(rt)),
                "share": att / r["truth_s"],
                "size": float(np.log(truth[k]) - np.log(truth).mean()),
                "rank_pos": k / (len(step) - 1),
                "change": float(np.log(r["predicted_s"] / r["predicted_before_s"])),
                "raised": float(r["role"] == "raised"),
                "cut": float(r["role"] == "cut"),
                "controller": r["dst_layer_s"] / r["compute_s"],
                "coverage": float(r["coverage_limited"] > 0),
                "first": float((i % 2 == 0) == (run == "sab")),  # dst_gain alternates who goes first
            }
        )
    return out


FEATURES = {
    "share": "attention share of the true price",
    "size": "log predicted time - step mean",
    "rank_pos": "rank index / 7 (emulated order)",
    "change": "DST's change of the prediction (log)",
    "raised": "raised by DST (0/1)",
    "controller": "per-layer controller share of the time",
    "coverage": "coverage-limited (0/1)",
    "first": "run first in its step pair (0/1)",
}


def groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rank-steps after the warm-up step, no load burst, by (run, skew)."""
    out = collections.defaultdict(list)
    for r in rows:
        if r["step"] > 0 and abs(r["rp"]) < BURST and abs(r["rt"]) < BURST:
            out[r["run"], r["skew"]].append(r)
    return dict(sorted(out.items()))


def ols(y: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Least squares with an intercept: coefficients, standard errors, R^2."""
    design = np.column_stack([np.ones(len(y)), x])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    res = y - design @ coef
    var = res @ res / max(len(y) - design.shape[1], 1)
    se = np.sqrt(np.diag(var * np.linalg.pinv(design.T @ design)))
    return coef[1:], se[1:], float(1 - res.var() / y.var())


def usable(rs: list[dict], names) -> list[str]:
    return [f for f in names if np.std([r[f] for r in rs]) > 1e-12 and np.all(np.isfinite([r[f] for r in rs]))]


def feature_table(rows: list[dict], ycol: str = "rp") -> str:
    """Per (run, skew) and feature: correlation with the residual, slope, the shift per standard
    deviation of the feature (in %), and the joint least-squares coefficient's shift per sd with
    its t statistic."""
    body = []
    for (run, skew), rs in groups(rows).items():
        y = np.array([r[ycol] for r in rs])
        names = usable(rs, FEATURES)
        x = np.array([[r[f] for f in names] for r in rs])
        coef, se, r2 = ols(y, x)
        for j, f in enumerate(names):
            xs = x[:, j]
            slope = np.polyfit(xs, y, 1)[0]
            body.append(
                [
                    run,
                    f"{skew:g}",
                    f,
                    f"{np.corrcoef(xs, y)[0, 1]:+.2f}",
                    f"{100 * slope * xs.std():+.2f}",
                    f"{100 * coef[j] * xs.std():+.2f} (t {coef[j] / se[j]:+.1f})",
                    f"{r2:.2f}" if j == 0 else "",
                    f"{100 * y.std():.2f}" if j == 0 else "",
                    len(rs) if j == 0 else "",
                ]
            )
    headers = ["run", "skew", "feature", "corr", "% per sd alone", "% per sd joint (t)", "joint R^2"]
    headers += ["residual sd %", "n"]
    return markdown_table(headers, body)


def rank_table(rows: list[dict]) -> str:
    """Mean residual (%) by rank index, per (run, skew): the emulated order."""
    body = []
    for (run, skew), rs in groups(rows).items():
        means = [100 * np.mean([r["rp"] for r in rs if r["rank"] == k]) for k in range(8)]
        se = 100 * np.std([r["rp"] for r in rs]) / np.sqrt(len(rs) / 8)
        share = [np.mean([r["share"] for r in rs if r["rank"] == k]) for k in range(8)]
        body.append([run, f"{skew:g}", *(f"{m:+.1f}" for m in means), f"{se:.1f}", f"{share[0]:.3f}-{share[-1]:.3f}"])
    return markdown_table(["run", "skew", *(f"rank {k}" for k in range(8)), "se", "share rank 0-7"], body)


def repeat_table(rows: list[dict]) -> tuple[str, dict]:
    """SAB's identical work (same skew, seed, step, rank and true price, in different files):
    the residual's part that repeats (a model could learn it) and the part that does not (timing
    noise: no model can)."""
    same = collections.defaultdict(list)
    for r in rows:
        if r["run"] == "sab" and r["step"] > 0 and abs(r["rt"]) < BURST:
            same[r["skew"], r["seed"], r["step"], r["rank"], round(r["truth"], 6)].append(r["rt"])
    body, out = [], {}
    for skew in sorted({k[0] for k in same}):
        reps = [v for k, v in same.items() if k[0] == skew and len(v) > 1]
        if not reps:
            continue
        n, m = sum(len(v) for v in reps), len(reps)
        noise = float(np.sqrt(sum(((np.array(v) - np.mean(v)) ** 2).sum() for v in reps) / (n - m)))
        means = np.array([np.mean(v) for v in reps])
        sizes = np.array([len(v) for v in reps])
        repeat = float(np.sqrt(max(means.var() - np.mean(noise**2 / sizes), 0.0)))
        out[skew] = (noise, repeat)
        body.append(
            [f"{skew:g}", m, f"{n / m:.1f}", f"{100 * noise:.2f}", f"{100 * repeat:.2f}", f"{100 * means.std():.2f}"]
        )
    headers = ["skew", "rank-steps measured again", "times each", "noise sd %", "repeating sd %"]
    headers += ["sd of means %"]
    return markdown_table(headers, body), out


def balance_bound(noise: float, ranks: int = 8, draws: int = 20000) -> float:
    """Median balance (mean / max) of ``ranks`` ranks predicted equal whose times carry only
    lognormal noise of sd ``noise``: what a perfect model leaves (fixed seed)."""
    z = np.random.default_rng(0).normal(0.0, noise, (draws, ranks))
    t = np.exp(z)
    return float(np.median(t.mean(1) / t.max(1)))


# ---------------------------------------------------------------- held-out fits
CANDIDATES = {
    "level": [],
    "level + split": ["share"],
    "+ size": ["share", "size"],
    "+ rank index": ["share", "rank_pos"],
    "+ DST change": ["share", "change"],
    "+ controller": ["share", "controller"],
}


def fit_score(train: list[dict], test: list[dict], feats: list[str]) -> float:
    """RMS (%) on ``test`` of the step-centred residual ``rt`` left by a least-squares fit of it
    on ``feats`` over ``train`` (features centred per step the same way)."""

    def centred(rs):
        by = collections.defaultdict(list)
        for r in rs:
            by[r["file"], r["seed"], r["run"], r["step"]].append(r)
        y, x = [], []
        for step in by.values():
            y += [r["rt"] - np.mean([q["rt"] for q in step]) for r in step]
            x += [[r[f] - np.mean([q[f] for q in step]) for f in feats] for r in step]
        return np.array(y), np.array(x).reshape(len(y), len(feats))

    y, x = centred(train)
    coef = np.linalg.lstsq(x, y, rcond=None)[0] if feats else np.zeros(0)
    yt, xt = centred(test)
    return float(100 * np.sqrt(np.mean((yt - xt @ coef) ** 2)))


def heldout_table(rows: list[dict]) -> str:
    """Per run kind and skew: fit on steps 1-3, score on steps 4+ (each file); and fit on one
    file, score on every other file of the same run kind and skew (mean over the pairs)."""
    body = []
    for (run, skew), rs in groups(rows).items():
        files = sorted({r["file"] for r in rs})
        for name, feats in CANDIDATES.items():
            later = np.mean(
                [
                    fit_score(
                        [r for r in rs if r["file"] == f and r["step"] <= 3],
                        [r for r in rs if r["file"] == f and r["step"] > 3],
                        feats,
                    )
                    for f in files
                ]
            )
            pairs = [(a, b) for a in files for b in files if a != b]
            across = np.mean(
                [
                    fit_score([r for r in rs if r["file"] == a], [r for r in rs if r["file"] == b], feats)
                    for a, b in pairs
                ]
            )
            body.append([run, f"{skew:g}", name, f"{later:.2f}", f"{across:.2f}"])
    headers = ["run", "skew", "model (fit on the true price)", "later steps RMS %", "other files RMS %"]
    return markdown_table(headers, body)


# ---------------------------------------------------------------- the online filter, replayed
def replay(
    rows: list[dict], noise: float, split_drift: float = SPLIT_DRIFT, split_std: float = SPLIT_STD
) -> dict[str, float]:
    """The online filter fed each rank's (attention, rest) seconds as the run's profile priced
    them and its measured time, rank by rank, step by step, one filter per run as in the
    trainer (a rank's sum stands in for its micro-batches: the filter's measurement is linear in
    them). Before each step (from the third) the filter predicts its ranks; scored: the RMS of
    the step-centred log error (what spreads the ranks), the RMS level error, and the mean gap
    between the predicted and the measured balance (mean / max)."""
    runs = collections.defaultdict(list)
    for r in rows:
        runs[r["file"], r["seed"], r["run"]].append(r)
    spread, level, gap, first = [], [], [], []
    for rs in runs.values():
        f = ScaleFilter(noise_std=noise, split_std=split_std, split_drift=split_drift)
        for i in sorted({r["step"] for r in rs}):
            step = sorted((r for r in rs if r["step"] == i), key=lambda r: r["rank"])
            att = np.array([r["skew"] * r["att"] for r in step])
            rest = np.array([r["truth"] - r["att"] for r in step])
            meas = np.array([r["compute"] for r in step])
            pred = f.theta[0] * att + f.theta[1] * rest
            err = np.log(meas / pred)
            if i >= 2 and np.all(np.abs(err - np.median(err)) < BURST):
                spread.append(err - err.mean())
                level.append(err.mean())
                gap.append(pred.mean() / pred.max() - meas.mean() / meas.max())
            for a, b, m in zip(att, rest, meas, strict=True):
                f.update(np.array([a, b]), float(m))
        first.append(f.theta[0] / f.theta[1])
    return {
        "spread": float(100 * np.sqrt(np.mean(np.concatenate(spread) ** 2))),
        "level": float(100 * np.sqrt(np.mean(np.square(level)))),
        "gap": float(np.mean(gap)),
        "ratio": float(np.median(first)),
    }


def hindsight(rows: list[dict]) -> dict[str, float]:
    """The best constant attention / rest ratio over the run's profile in hindsight (a grid
    over 1/4-8, fitted on the very steps it is scored on: an upper bound for any split-learning
    filter), scored like :func:`replay` (the level drops out of the step-centred error and the
    balance)."""
    best = None
    for ratio in np.exp(np.linspace(np.log(0.25), np.log(8.0), 61)):
        by = collections.defaultdict(list)
        for r in rows:
            if r["step"] >= 2:
                by[r["file"], r["seed"], r["run"], r["step"]].append(
                    (ratio * r["skew"] * r["att"] + r["truth"] - r["att"], r["compute"])
                )
        spread, gap = [], []
        for step in by.values():
            pred, meas = np.array(step).T
            err = np.log(meas / pred)
            if np.all(np.abs(err - np.median(err)) < BURST):
                spread.append(err - err.mean())
                gap.append(pred.mean() / pred.max() - meas.mean() / meas.max())
        rms = float(100 * np.sqrt(np.mean(np.concatenate(spread) ** 2)))
        if best is None or rms < best["spread"]:
            best = {"spread": rms, "level": float("nan"), "gap": float(np.mean(gap)), "ratio": float(ratio)}
    return best


def replay_table(rows: list[dict], noise: float) -> str:
    body = []
    for run in ("sab", "sab+dst"):
        for skew in sorted({r["skew"] for r in rows}):
            rs = [r for r in rows if r["run"] == run and r["skew"] == skew]
            variants = {
                "today's filter": replay(rs, noise),
                "split drift 0.03 (10x)": replay(rs, noise, split_drift=0.03),
                "split prior ln 4 (2x wider)": replay(rs, noise, split_std=float(np.log(4.0))),
                "best constant split, hindsight": hindsight(rs),
            }
            for name, s in variants.items():
                body.append(
                    [
                        run,
                        f"{skew:g}",
                        name,
                        f"{s['spread']:.2f}",
                        "" if np.isnan(s["level"]) else f"{s['level']:.2f}",
                        f"{s['gap']:+.3f}",
                        f"{s['ratio']:.2f}",
                    ]
                )
    headers = [
        "run",
        "skew",
        "calibration",
        "rank error RMS % (step-centred)",
        "level error RMS %",
        "balance predicted - measured",
        "att/rest ratio over the run's profile (median at the end)",
    ]
    return markdown_table(headers, body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="dst_gain.py results (.json); files without per-rank records are skipped")
    p.add_argument("--out", default=None, help="write the report (markdown) here too")
    args = p.parse_args()
    rows = load(args.files)
    if not rows:
        p.error("no file with per-rank records (dst_gain.py's per_rank)")
    profiles = {r["profile"] for r in rows}
    if len(profiles) != 1 or None in profiles:
        p.error(f"the files must share one --profile (the filter's noise is its), got {sorted(map(str, profiles))}")
    noise = measurement_noise(load_profile(profiles.pop()))
    files = sorted({r["file"] for r in rows})
    repeats, sds = repeat_table(rows)
    parts = [
        f"Files ({len(files)}): " + ", ".join(files) + f". Rank-steps: {len(rows)} (step 0, the warm-up, and "
        f"residuals beyond {np.exp(BURST):g}x the step's median left out below).",
        "## Residual against DST's prediction, one feature at a time and jointly\n\n" + feature_table(rows, "rp"),
        "## The same against the true profile's price\n\n" + feature_table(rows, "rt"),
        "## Mean residual by rank index (%)\n\n" + rank_table(rows),
        "## What repeats: SAB's identical work measured in different files\n\n" + repeats,
        "Balance (median mean/max) of 8 ranks predicted equal, timing noise only: "
        + ", ".join(f"noise {100 * n:.1f} % -> {balance_bound(n):.3f}" for n, _ in sds.values())
        + f"; with 3 % noise -> {balance_bound(0.03):.3f}.",
        "## Held out: fit on earlier steps or another file, score the step-centred residual\n\n" + heldout_table(rows),
        f"## The online filter replayed (noise {noise:.3f}, the profile's)\n\n" + replay_table(rows, noise),
    ]
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        prefix = os.path.commonprefix(args.files)  # noqa: RUF071 - a string prefix on purpose: the glob's
        same = sorted(glob.glob(prefix + "*.json")) == sorted(args.files)  # the shell's glob, given back
        named = prefix + "*.json" if same and len(args.files) > 1 else " ".join(shlex.quote(f) for f in args.files)
        cmd = f"python benchmarks/latency_residuals.py {named} --out {shlex.quote(args.out)}"
        Path(args.out).write_text(f"# latency residuals — {Path(args.out).stem[:10]}\n\nCommand: `{cmd}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
