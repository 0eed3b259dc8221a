"""``sparsebalance bench-e2e``: the baseline / SAB / DST / SAB+DST ablation measured end to end with
the real trainer on the same samples (2 gloo ranks on CPU, or ``--emulate-ranks R`` to run R ranks'
micro-batches in turn on one device), with the simulator's prediction for the same batches beside
it. Writes a dated results file.

Hybrid rows (``--strategies baseline,sab,sab+cp,sab+cp+dst``): ``sab-cp`` plans train documents
longer than the capacity whole over CP units of real ranks (no ``--emulate-ranks``); the
whole-document rows cut them by ``--overlong`` (``split`` by default). The results file is then
``<date>-bench-e2e-hybrid-<device>``, with the measured speed-up of SAB+CP over SAB and its
prediction error."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from ..files import check_output_folder
from ..report import comparison_table
from ..results import write_results
from ..train import add_train_arguments, config_from_args
from ..train.ablation import ABLATION, HYBRID, ablation_configs, measure, predict
from ..train.launch import add_nproc_argument, default_nproc, uses_cuda


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strategies",
        default=",".join(ABLATION),
        help=f"comma-separated subset of {', '.join(ABLATION + HYBRID)} (baseline always runs; "
        "sab+cp, sab+cp+dst: hybrid data x context parallel, long documents trained whole)",
    )
    add_nproc_argument(p)
    p.add_argument(
        "--results-dir", default="benchmarks/results", help="folder of the dated results file ('' to write nothing)"
    )
    p.add_argument(
        "--reuse-runs",
        action="store_true",
        help="report the runs already in --out instead of training again",
    )
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")
    add_train_arguments(p)


def main(args: argparse.Namespace) -> int:
    if args.out is None:
        args.out = "runs/bench-e2e"
    cfg = config_from_args(args)
    if args.results_dir:  # before minutes of training: the results file can be written
        check_output_folder(args.results_dir, "--results-dir")
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    configs = ablation_configs(cfg, names)
    cuda = uses_cuda(cfg)
    nproc = default_nproc(cfg, args.nproc)
    world = cfg.emulate_ranks or nproc
    hybrid = [n for n in configs if n in HYBRID]
    load_before = os.getloadavg()
    measured = measure(configs, nproc, reuse=args.reuse_runs)
    load_after = os.getloadavg()
    baseline_dir = Path(configs["baseline"].out)
    hybrid_dir = Path(configs[hybrid[0]].out) if hybrid else None
    sim = predict(cfg, list(configs), world, baseline_dir, hybrid_dir)
    predicted = sim["strategies"]
    table, payload = comparison_table(measured, "baseline", predicted)
    mode = f"{cfg.emulate_ranks} emulated ranks" if cfg.emulate_ranks else f"{nproc} processes"
    notes = (
        f"{mode}, model {cfg.model}, {cfg.steps} steps (step 1 excluded), global batch "
        f"{cfg.global_batch}, capacity {cfg.capacity}, {cfg.dst.describe()}. Speedup: baseline "
        "mean step time / strategy's; compute speedup uses the slowest rank's compute time. "
        "Predicted: the simulator on the same batches with the baseline run's latency model "
        "(its profile, recalibrated online up to its last step) and the estimator's starting "
        "densities; its error is against the measured slowest-rank compute time."
        f" Load average (1, 5, 15 min) before the runs {_load(load_before)}, after "
        f"{_load(load_after)}."
    )
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "strategies": payload,
        "load_before": load_before,
        "load_after": load_after,
    }
    if hybrid:
        # the same prediction with the ring terms as the profile gives them (not recalibrated):
        # what the measured CP units taught the model
        raw = predict(cfg, list(configs), world, baseline_dir)["strategies"]
        measured_compute = {n: r["mean_max_compute_s"] for n, r in payload.items()}
        uncal = {n: raw[n]["step_seconds"] / measured_compute[n] - 1 for n in hybrid}
        extra, result["hybrid"] = _hybrid_notes(cfg, payload, hybrid, sim["context_cost"], uncal)
        notes += "\n\n" + extra
    if args.results_dir:
        device = torch.device("cuda" if cuda else "cpu")
        name = "bench-e2e-hybrid" if hybrid else "bench-e2e"
        md, _ = write_results(args.results_dir, name, device, table, result, notes)
        result["results_file"] = str(md)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(table + "\n\n" + notes + (f"\n\nwrote {result['results_file']}" if args.results_dir else ""))
    return 0


def _load(avg) -> str:
    return " / ".join(f"{x:.2f}" for x in avg)


def _hybrid_notes(cfg, rows: dict, hybrid: list[str], cost: dict, uncalibrated: dict[str, float]) -> tuple[str, dict]:
    """The hybrid rows against whole-document SAB: measured speed-up, predicted speed-up and the
    prediction's error, with and without the recalibrated ring terms (JSON-ready as well)."""
    out = {
        "overlong": cfg.overlong,
        "capacity": cfg.capacity,
        "context_cost": cost,
        "prediction_error_ring_terms_as_profiled": uncalibrated,
    }
    whole = ", ".join(n for n in rows if n not in hybrid)
    lines = [
        f"Hybrid rows: ``sab-cp`` trains documents longer than the capacity ({cfg.capacity} "
        f"tokens) whole over context-parallel units of real ranks; the whole-document rows "
        f"({whole}) cut them with --overlong {cfg.overlong}. Ring terms of the prediction: "
        f"recalibrated by the {hybrid[0]} run's measured CP units (compute scale "
        f"{cost['compute_scale']:.3g}, transfer scale {cost['comm_scale']:.3g}, imbalance "
        f"flat {cost['imbalance']['flat']:.3g}; links {cost['links']['source']}); with the ring "
        "terms as profiled (scales 1) the step predictions are off by "
        + ", ".join(f"{100 * e:+.0f} % ({n})" for n, e in uncalibrated.items())
        + ". Timing figures are noisy: other jobs may share the machine (see the load); the "
        "command above re-runs the whole comparison."
    ]
    if "sab" in rows:
        base = rows["sab"]
        for name in hybrid:
            r = rows[name]
            measured = base["mean_step_s"] / r["mean_step_s"]
            compute = base["mean_max_compute_s"] / r["mean_max_compute_s"]
            predicted = base["predicted_step_s"] / r["predicted_step_s"]
            out[name] = {
                "speedup_over_sab": measured,
                "compute_speedup_over_sab": compute,
                "predicted_speedup_over_sab": predicted,
                "prediction_error": r["prediction_error"],
            }
            lines.append(
                f"{name} over whole-document sab: measured speed-up {measured:.2f}x (step), "
                f"{compute:.2f}x (slowest-rank compute); predicted {predicted:.2f}x; the "
                f"prediction of its step is off by {100 * r['prediction_error']:+.0f} %."
            )
    return "\n".join(lines), out
