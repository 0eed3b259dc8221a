"""Measured memory coefficients: fit on a few probes, check on held-out configurations.

    PYTHONPATH=src python benchmarks/memory_calibration.py --model tiny [--date 2026-11-23]

What ``sparsebalance profile --memory`` does (fresh-process probes, peak RSS on CPU, fit of
``act_bytes`` and a constant overhead; :mod:`sparsebalance.latency.memory_fit`), then further
fresh-process probes that the fit did not see (other lengths, checkpointing modes, the plain
loss): for each, the measured peak against the calibrated and the analytic prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from sparsebalance.latency import fingerprint
from sparsebalance.latency.memory import GIB, MemoryModel, cpu_coefficients
from sparsebalance.latency.memory_fit import memory_fingerprint
from sparsebalance.models import load_shapes
from sparsebalance.results import markdown_table
from sparsebalance.train.memory_probe import measure_memory, run_probes, tied_embeddings

HERE = Path(__file__).parent
HELD_OUT = [
    (8192, "off", "chunked"),
    (4096, "full", "chunked"),
    (4096, "selective", "chunked"),
    (2048, "off", "plain"),
    (512, "off", "chunked"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--fit-tokens", default="1024,2048,4096")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--date", default=date.today().isoformat())
    p.add_argument("--out-dir", default=str(HERE / "results"))
    a = p.parse_args()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    dev = torch.device("cpu")
    shapes = load_shapes(a.model)
    fp = memory_fingerprint(fingerprint(shapes, dev, "fp32", "torch", a.block_size), tied_embeddings(a.model))
    tokens = [int(x) for x in a.fit_tokens.split(",")]
    cal = measure_memory(a.model, dev, fp, tokens, block_size=a.block_size)
    fit_seconds = time.perf_counter() - t0
    rows = []
    for pr, err, an in zip(cal.probes, cal.errors, cal.analytic_errors, strict=True):
        peak = pr.peak_bytes / GIB
        rows.append(["fit", pr.tokens, pr.checkpointing, pr.loss, peak, peak * (1 + err), err, peak * (1 + an), an])
    tied = tied_embeddings(a.model)
    held_err, held_an = [], []
    for t, ckpt, loss in HELD_OUT:
        (pr,) = run_probes(a.model, dev, [t], ckpt, loss, block_size=a.block_size)
        cfg = pr.config(a.block_size)
        calib = MemoryModel(shapes, cal.coefficients(cpu_coefficients(pr.base_bytes)), tied)
        plain = MemoryModel(shapes, cpu_coefficients(pr.base_bytes), tied)
        pc, pa = calib.peak_bytes(t, cfg), plain.peak_bytes(t, cfg)
        e, ea = (pc - pr.peak_bytes) / pr.peak_bytes, (pa - pr.peak_bytes) / pr.peak_bytes
        held_err.append(e)
        held_an.append(ea)
        rows.append(["held out", t, ckpt, loss, pr.peak_bytes / GIB, pc / GIB, e, pa / GIB, ea])
    table = markdown_table(
        [
            "probe",
            "tokens",
            "checkpointing",
            "loss",
            "measured GiB",
            "calibrated GiB",
            "calibrated error",
            "analytic GiB",
            "analytic error",
        ],
        rows,
    )
    summary = {
        "model": a.model,
        "act_bytes": cal.act_bytes,
        "overhead_mib": cal.overhead_bytes / 2**20,
        "fit_seconds": fit_seconds,
        "fit_max_abs_error": cal.max_error,
        "held_out_mean_abs_error_calibrated": float(np.mean(np.abs(held_err))),
        "held_out_max_abs_error_calibrated": float(np.max(np.abs(held_err))),
        "held_out_mean_abs_error_analytic": float(np.mean(np.abs(held_an))),
        "held_out_max_abs_error_analytic": float(np.max(np.abs(held_an))),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "calibration": cal.to_json(),
    }
    name = f"{a.date}-memory-calibration-cpu"
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    lb, la = load_before, summary["load_after"]
    md = [
        f"# Memory model: measured coefficients (profile --memory) vs analytic — {a.date}",
        "",
        f"Command: `PYTHONPATH=src python benchmarks/memory_calibration.py --model {a.model} "
        f"--fit-tokens {a.fit_tokens} --date {a.date}` (every probe one fresh process, "
        "`python -m sparsebalance.train.memory_probe`, peak RSS = "
        f"`{cal.probes[0].source}`, the probe's own high-water mark)",
        f"Machine: 2 shared CPU cores, 24 GB RAM; load average {lb[0]:.2f} {lb[1]:.2f} "
        f"{lb[2]:.2f} before, {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} after (the machine is shared: "
        "times depend on other jobs; peaks are per-process and do not).",
        "",
        f"Fitted on {len(cal.probes)} probes (checkpointing off, chunked loss, "
        f"{a.fit_tokens} tokens; {fit_seconds:.0f} s): "
        f"act_bytes = {cal.act_bytes:.2f} bytes per saved element (analytic 4.0), overhead "
        f"{cal.overhead_bytes / 2**20:+.0f} MiB beyond the base.",
        "",
        table,
        "",
        "```json",
        json.dumps({k: v for k, v in summary.items() if k != "calibration"}, indent=1),
        "```",
        "",
    ]
    (out / f"{name}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
