"""Measured CP units of a hybrid training run against the ring-term model, recalibrated or not.

For every context-parallel unit (k > 1) in ``RUN/metrics.jsonl``: its measured time (from its last
rank's arrival to its last rank's end, from the per-rank ``units`` records), and its per-rank time
predicted by the run's ``ContextCost`` over the run's final latency model, once with the ring
terms the run recalibrated (checkpoint ``context``) and once as profiled (compute and transfer
scales 1, default imbalance). Density: the unit's logged mean realized density, else the mean of
its ranks' record densities (runs before units logged one).

    python benchmarks/cp_unit_calibration.py runs/bench-e2e-hybrid/sab_cp \
        --results-dir benchmarks/results

Writes ``<date>-cp-unit-calibration-cpu.md/.json``. Not a timing benchmark of its own: it reads
the times a run measured (see that run's results file for the machine's load).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np
import torch

from sparsebalance.latency import LatencyModel, context_cost, load_profile
from sparsebalance.results import markdown_table, write_results
from sparsebalance.train.checkpoint import latest_checkpoint, load_state


def measured_units(run: Path) -> list[dict]:
    """One entry per CP unit of the run: step, slot, tokens L, degree k, density, seconds."""
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    groups: dict[tuple[int, int], list[tuple[dict, dict]]] = {}
    for rec in recs:
        if rec.get("rank") == "all":
            continue
        for u in rec.get("units", ()):
            if u["degree"] > 1:
                groups.setdefault((rec["step"], u["slot"]), []).append((rec, u))
    out = []
    for (step, slot), parts in sorted(groups.items()):
        units = [u for _, u in parts]
        if len(units) != units[0]["degree"] or any(u["start_s"] is None for u in units):
            continue  # a rank's record missing, or no start stamps: no unit time
        start = max(u["start_s"] for u in units)
        end = max(u["start_s"] + u["seconds"] for u in units)
        dens = units[0].get("density")
        if dens is None:
            dens = float(np.mean([r["density"] for r, _ in parts]))
        out.append(
            {
                "step": step,
                "slot": slot,
                "tokens": sum(u["tokens"] for u in units),
                "degree": units[0]["degree"],
                "density": dens,
                "seconds": end - start,
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a sab-cp run folder (metrics.jsonl, checkpoints)")
    p.add_argument("--block-size", type=int, default=None, help="default: the profile's")
    p.add_argument("--results-dir", default="", help="write the dated results file there")
    args = p.parse_args()
    run = Path(args.run)
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        raise SystemExit(f"{run}: no checkpoint (the recalibrated terms live there)")
    state = load_state(ckpt)["trainer"]  # checksums verified, weights-only
    if state.get("context") is None:
        raise SystemExit(f"{run}: the checkpoint has no ring terms (not a sab-cp run?)")
    latency = LatencyModel(load_profile(run / "latency_profile.json"))
    latency.load_state_dict(state["latency"])
    kw = {} if args.block_size is None else {"block_size": args.block_size}
    calibrated, profiled = context_cost(latency, "h100", **kw), context_cost(latency, "h100", **kw)
    calibrated.load_state_dict(state["context"])
    units = measured_units(run)
    if not units:
        raise SystemExit(f"{run}: no CP unit with every rank's stamped record")
    lens, dens, ks = (np.array([u[k] for u in units]) for k in ("tokens", "density", "degree"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short shards lie below the profiled grid
        cal, _ = calibrated.unit_seconds(lens, np.clip(dens, 1e-3, 1.0), ks)
        raw, _ = profiled.unit_seconds(lens, np.clip(dens, 1e-3, 1.0), ks)
    rows = []
    for u, c, r in zip(units, cal, raw, strict=True):
        u.update(calibrated=float(c), as_profiled=float(r), err_cal=c / u["seconds"] - 1, err_raw=r / u["seconds"] - 1)
        rows.append(
            [
                u["step"],
                u["slot"],
                u["tokens"],
                u["degree"],
                u["density"],
                u["seconds"],
                u["calibrated"],
                f"{100 * u['err_cal']:+.0f} %",
                u["as_profiled"],
                f"{100 * u['err_raw']:+.0f} %",
            ]
        )
    last = max(u["step"] for u in units)
    late = [u for u in units if u["step"] > last - max(1, last // 3)]

    def mae(us, key):
        return float(np.mean([abs(u[key]) for u in us]))

    summary = {
        "units": len(units),
        "late_steps_from": min(u["step"] for u in late),
        "mae_calibrated": mae(units, "err_cal"),
        "mae_as_profiled": mae(units, "err_raw"),
        "mae_calibrated_late": mae(late, "err_cal"),
        "mae_as_profiled_late": mae(late, "err_raw"),
        "terms": state["context"],
    }
    table = markdown_table(
        ["step", "slot", "tokens", "k", "density", "measured s", "recalibrated s", "error", "as profiled s", "error"],
        rows,
    )
    notes = (
        f"Run `{run}`; ring terms after its last step: {json.dumps(state['context'])}. "
        f"Mean |error| over all {len(units)} units: recalibrated "
        f"{100 * summary['mae_calibrated']:.0f} %, as profiled "
        f"{100 * summary['mae_as_profiled']:.0f} %; over the units of steps >= "
        f"{summary['late_steps_from']} (after most updates): recalibrated "
        f"{100 * summary['mae_calibrated_late']:.0f} %, as profiled "
        f"{100 * summary['mae_as_profiled_late']:.0f} %. The terms are the run's final ones, so "
        "early units are predicted with what later units taught (in-sample)."
    )
    print(table + "\n\n" + notes)
    if args.results_dir:
        md, _ = write_results(
            args.results_dir,
            "cp-unit-calibration",
            torch.device("cpu"),
            table,
            {"units": units, "summary": summary},
            notes,
        )
        print(f"wrote {md}")


if __name__ == "__main__":
    main()
