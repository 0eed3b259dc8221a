"""Accuracy and cost of the default latency profile, three fresh profiles in a row (issue 19).

    python benchmarks/profile_accuracy.py [--model tiny] [--max-len 4096] [--runs 3]
        [--num-batches 30] [--heldout-rounds 5] [--budget 50] [--threads N]
        [--out-dir benchmarks/results] [--name profile-accuracy]

1. Measures ``--runs`` fresh profiles exactly as the trainer does on first use
   (:func:`sparsebalance.latency.measure.measure_profile`, default budget) with the CPU threads
   a rank of ``sparsebalance train`` runs with (``--threads``, default as ``sparsebalance
   profile``: 1 for train's 2 CPU processes), timing each; right after each, 6 fixed *probe*
   micro-batches are timed (2 rounds): the machine's speed at that moment.
2. Times ``--num-batches`` held-out micro-batches once, with the same threads (1-4 documents,
   lengths log-uniform in 128 .. max-len and none of any profile's design lengths, densities
   uniform in [0.04, 0.95]; median of ``--heldout-rounds`` interleaved rounds: the truth's own
   noise would count as the profile's error) — the ground truth does not depend on the
   profile, so every profile is validated against the same times.
3. Prints and writes (dated ``.md`` + ``.json``) the table: profiling seconds, noise, MAPE with a
   95 % bootstrap interval, max error, level and shape errors, the machine's drift (the probes
   after each profile vs the same probes timed inside the held-out rounds), per-component
   errors, the spread of MAPE across runs, and
   the 1-minute load average before and after (other jobs may share the machine: say so).
Also evaluates, as a reference row, any profile given with ``--reference`` (``--runs 0``:
only those, e.g. to compare two versions' profiles on one held-out set).
Runs in ~8 minutes on an idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sparsebalance.latency import LatencyModel, load_profile
from sparsebalance.latency.heldout import measure_heldout
from sparsebalance.latency.measure import measure_profile, noise_line
from sparsebalance.latency.sweep import Timings, random_batches
from sparsebalance.latency.validate import validation_summary
from sparsebalance.models import load_shapes
from sparsebalance.results import markdown_table, write_results
from sparsebalance.timing import torch_threads
from sparsebalance.train.launch import CPU_NPROC, rank_threads

OUT = Path(__file__).parent / "results"
PROBES = 6


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def pct(x: float | None, sign: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{100 * x:+.1f} %" if sign else f"{100 * x:.1f} %"


def row(name: str, summary: dict, profile_s: float | None, profile, drift: float | None) -> list:
    comp = summary["breakdown"]["component_error"]
    lo, hi = summary["mape_ci95"]
    noise = profile.noise.get("cv_median") if profile.noise else None
    loo = profile.fit.get("loo_mape") if profile.fit else None
    return [
        name,
        "-" if profile_s is None else f"{profile_s:.1f}",
        len(profile.fit.get("design", [])) if profile.fit else "-",
        pct(noise),
        pct(loo),
        f"{pct(summary['mape'])} [{100 * lo:.1f}, {100 * hi:.1f}]",
        pct(summary["max_error"]),
        pct(summary["level"], True),
        pct(drift, True),
        f"{pct(summary['shape_mape'])} ({pct(summary['shape_max_error'])})",
        pct(comp["attention"], True),
        pct(comp["per_token"], True),
        pct(comp["overhead"], True),
    ]


def goal_lines(mapes: list[float], max_errors: list[float], seconds: list[float], shapes: list[float]) -> str:
    """One line per goal of issue 19: the numbers and whether each is met."""
    if not mapes:
        return "Goals (issue 19): no fresh profile measured (--runs 0)."

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    spread = max(mapes) - min(mapes)
    return "\n".join(
        [
            "Goals (issue 19), the default profile, fresh each time:",
            f"- MAPE <= 10 %: {', '.join(pct(m) for m in mapes)} -> {verdict(max(mapes) <= 0.10)}",
            f"- max error <= 25 %: {', '.join(pct(m) for m in max_errors)} -> {verdict(max(max_errors) <= 0.25)}",
            f"- MAPE spread <= 3 points: {100 * spread:.1f} points -> {verdict(spread <= 0.03)}"
            f" (shape MAPE {', '.join(pct(m) for m in shapes)}: spread "
            f"{100 * (max(shapes) - min(shapes)):.1f} points)",
            f"- profiling <= 60 s: {', '.join(f'{s:.0f} s' for s in seconds)} -> {verdict(max(seconds) <= 60)}",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--max-len", type=int, default=4096, help="the run's capacity (tokens)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-batches", type=int, default=30)
    p.add_argument("--heldout-rounds", type=int, default=5, help="timings per held-out batch")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: a rank's)")
    p.add_argument("--budget", type=float, default=50.0, help="measure_profile's budget_s")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--reference", action="append", default=[], help="old profile(s) to compare")
    p.add_argument("--out-dir", default=str(OUT))
    p.add_argument("--name", default="profile-accuracy")
    p.add_argument(
        "--save-profiles",
        default=None,
        metavar="DIR",
        help="also write each fresh profile there (profile-1.json, ...)",
    )
    p.add_argument("--note", default="", help="a line for the results file (how --reference profiles were made)")
    args = p.parse_args()
    if args.runs < (0 if args.reference else 1) or args.num_batches < 2:
        raise ValueError("--runs must be >= 1 (>= 0 with --reference) and --num-batches >= 2")
    if args.heldout_rounds < 2:
        raise ValueError(f"--heldout-rounds must be >= 2, got {args.heldout_rounds}")
    threads = args.threads or rank_threads(CPU_NPROC)
    with torch_threads(threads):
        run(args, threads)


def run(args: argparse.Namespace, threads: int) -> None:
    shapes, device = load_shapes(args.model), torch.device("cpu")
    load_before = load_line()
    t_all = time.perf_counter()
    profiles, seconds, probes = [], [], []
    probe = random_batches(PROBES, args.max_len // 2, 128, seed=11)
    for i in range(args.runs):
        t0 = time.perf_counter()
        prof = measure_profile(
            shapes,
            device,
            "fp32",
            "auto",
            block_size=args.block_size,
            max_len=args.max_len,
            budget_s=args.budget,
            quiet=True,
        )
        seconds.append(time.perf_counter() - t0)
        profiles.append(prof)
        if args.save_profiles:
            Path(args.save_profiles).mkdir(parents=True, exist_ok=True)
            prof.save(Path(args.save_profiles) / f"profile-{i + 1}.json")
        print(f"run {i + 1}: {seconds[-1]:.1f} s; " + noise_line(prof), file=sys.stderr)
        # the machine's speed right after this profile: a fixed probe set, timed again at the
        # end inside the held-out rounds (the truth's time), so a profile's level error can be
        # told apart from the machine having been faster or slower while it was measured
        probes.append(
            measure_heldout(shapes, probe, device, "fp32", prof.fingerprint["backend"], args.block_size, 2).median
        )
    refs_p = [load_profile(path) for path in args.reference]
    design = {n for prof in profiles + refs_p for pt in prof.fit.get("design", []) for n in pt["lengths"]}
    batches = random_batches(args.num_batches, args.max_len, 128, seed=1, exclude=design)
    backend = (profiles + refs_p)[0].fingerprint["backend"]
    t0 = time.perf_counter()
    timed = measure_heldout(shapes, batches + probe, device, "fp32", backend, args.block_size, args.heldout_rounds)
    heldout_s = time.perf_counter() - t0
    heldout = Timings(timed.seconds[:, : len(batches)], timed.wall_seconds)
    measured = heldout.median.tolist()
    probe_end = timed.median[len(batches) :]
    drifts = [float(np.median(p / probe_end)) - 1.0 for p in probes]
    summaries = [validation_summary(LatencyModel(pr), batches, measured) for pr in profiles]
    rows = [row(f"fresh profile {i + 1}", s, seconds[i], profiles[i], drifts[i]) for i, s in enumerate(summaries)]
    refs = []
    for path, ref in zip(args.reference, refs_p, strict=True):
        refs.append({"profile": path, **validation_summary(LatencyModel(ref), batches, measured)})
        rows.append(row(f"reference: {Path(path).name}", refs[-1], None, ref, None))
    mapes = [s["mape"] for s in summaries]
    table = markdown_table(
        [
            "profile",
            "profiling s",
            "design points",
            "noise CV",
            "fit LOO",
            "MAPE [95 % CI]",
            "max error",
            "level",
            "machine drift",
            "shape MAPE (max)",
            "attention err",
            "per-token err",
            "overhead err",
        ],
        rows,
    )
    load_after = load_line()
    goals = goal_lines(mapes, [s["max_error"] for s in summaries], seconds, [s["shape_mape"] for s in summaries])
    notes = "\n".join(
        [
            goals,
            "",
            f"Held-out set: {len(batches)} micro-batches (1-4 documents, 128..{args.max_len} tokens, "
            f"off-design lengths, densities 0.04-0.95), median of {heldout.seconds.shape[0]} "
            f"interleaved rounds, timed once ({heldout_s:.0f} s) and shared by every profile; its "
            f"timing noise (CV of one timing, median) {pct(heldout.noise()['cv_median'])}.",
            f"Level: median of predicted / measured - 1 (one global scale: the trainer's online "
            f"recalibration removes it in 1-2 steps); shape MAPE: the error once it is divided out. "
            f"Machine drift: the speed of this machine right after each profile vs while the "
            f"held-out set was timed, from {PROBES} probe micro-batches timed at both moments "
            f"(+5 % = the machine was 5 % slower during the profile): a level error that the drift "
            f"matches is the machine's, not the profile's.",
            f"CPU threads (profiles and held-out): {threads}. Load average (1, 5, 15 min) before: "
            f"{load_before}; after: {load_after}. "
            "This machine is shared: other jobs ran during the measurement unless the load says "
            "otherwise.",
            f"Total wall time {time.perf_counter() - t_all:.0f} s.",
            *([args.note] if args.note else []),
        ]
    )
    payload = {
        "model": args.model,
        "max_len": args.max_len,
        "budget_s": args.budget,
        "threads": threads,
        "heldout_rounds": args.heldout_rounds,
        "load_before": load_before,
        "load_after": load_after,
        "profiling_seconds": seconds,
        "mape": mapes,
        "mape_spread": max(mapes) - min(mapes) if mapes else None,
        "heldout_noise": heldout.noise(),
        "machine_drift": drifts,
        "probe": [{"lengths": b[0], "densities": b[1]} for b in probe],
        "runs": [
            {
                "profile_seconds": s,
                "noise": pr.noise,
                "fit": {k: v for k, v in pr.fit.items() if k != "design"},
                **{k: v for k, v in sm.items() if k != "batches"},
            }
            for s, pr, sm in zip(seconds, profiles, summaries, strict=True)
        ],
        "references": [{k: v for k, v in r.items() if k != "batches"} for r in refs],
        "heldout": [
            {
                "lengths": b[0],
                "densities": b[1],
                "seconds": m,
                "predicted": [s["batches"][i]["predicted"] for s in summaries],
            }
            for i, (b, m) in enumerate(zip(batches, measured, strict=True))
        ],
    }
    md, _ = write_results(args.out_dir, args.name, device, table, payload, notes)
    print(table + "\n\n" + notes + f"\n\nwrote {md}")


if __name__ == "__main__":
    main()
