"""Zero bubble (``--pp-schedule zb-h1``) against 1F1B, measured in the trainer at PP 2 (issue 54).

    PYTHONPATH=src python benchmarks/pipeline_zero_bubble.py [--steps 12] [--layers 8]

What runs: ``sparsebalance train``'s trainer on 2 gloo processes (one pipeline of 2 stages, fp32,
CPU, one thread each, DST off, ``--parallel ddp``), on a model of width 512 of the tiny model's
shape family (``--layers`` decoder layers, a 4,096-token tied vocabulary), 8 documents of 150-400
tokens per step, ``--capacity 512`` (4-5 micro-batches a step). The same processes hold two
trainers, 1F1B and ZB-H1, and run their steps in turn on the same samples (the same seed and
data), so load drift hits both.

Measured, per step pair (step 1 of each, which builds the optimizer state, left out):
- the step's wall time under each schedule, and their ratio (1F1B / ZB-H1: above 1, zero bubble
  is faster);
- the stages' idle share (the pipeline's span less each stage's own ops);
- from the ZB-H1 step's own measured ops (each micro-batch's forward, B and W on each stage, in
  the order run): ZB-H1's exact makespan of them and 1F1B's of the same ops (B + W fused), so the
  gain the pricing predicts from what ran, beside the gain measured, and the measured step over
  its ops' ZB-H1 makespan (how exact the pricing is; the rest is sends and the host);
- W's share of the backward (what the stages' calibration learns).
Writes ``benchmarks/results/<date>-pipeline-zero-bubble-cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from pipeline_overlap import prepare, train_config  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1")


def _rank(rank: int, root: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from sparsebalance.engine.runtime import Runtime
    from sparsebalance.train import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=rank, world_size=2)
    files = json.loads(Path(root, "files.json").read_text())
    trainers = {}
    for schedule in SCHEDULES:
        cfg = train_config(files, f"{root}/run-{schedule}", steps, pp_schedule=schedule, parallel="ddp")
        trainers[schedule] = Trainer(cfg, Runtime(rank, 2, torch.device("cpu")))
    rows = []
    for _ in range(steps):
        row = {}
        for schedule, trainer in trainers.items():
            result = trainer.run_step()
            rec = result.records[0]
            row[schedule] = {
                "step_s": result.report.step_seconds,
                "stages": rec.stages,
                "units": [u.get("stage_s") for u in rec.units],
            }
        rows.append(row)
    if rank == 0:
        Path(root, "steps.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _worker(root: str, steps: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(root, steps), nprocs=2, join=True)


def run(steps: int, layers: int) -> list[dict]:
    """One set of 2 processes; per step, both schedules' measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--prepare", tmp, "--layers", str(layers)]
        files = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        Path(tmp, "files.json").write_text(files.stdout)
        subprocess.run([sys.executable, __file__, "--worker", tmp, "--steps", str(steps)], env=env, check=True)
        return json.loads(Path(tmp, "steps.json").read_text())


def priced(units: list) -> tuple[float, float, float]:
    """From one ZB-H1 step's measured ops ``[[f, b + w, w] per stage] per micro-batch``: its ZB-H1
    makespan, 1F1B's makespan of the same ops, and W's share of the backward."""
    from sparsebalance.batching.schedule import makespans
    from sparsebalance.batching.zero_bubble import makespans as zb_makespans

    ops = np.asarray(units, dtype=np.float64)  # (M, P, 3)
    f, bw, w = ops[..., 0], ops[..., 1], ops[..., 2]
    zb = float(zb_makespans(f[None], (bw - w)[None], w[None])[0])
    plain = float(makespans(f[None], bw[None])[0])
    return zb, plain, float(w.sum() / bw.sum())


def summarise(rows: list[dict]) -> dict:
    later = rows[1:]
    pairs = [r["1f1b"]["step_s"] / r["zb-h1"]["step_s"] for r in later]
    idle = {
        s: statistics.mean(
            sum(x["idle_s"] for x in r[s]["stages"]) / sum(x["idle_s"] + x["busy_s"] for x in r[s]["stages"])
            for r in later
        )
        for s in SCHEDULES
    }
    zb, plain, share = zip(*(priced(r["zb-h1"]["units"]) for r in later), strict=True)
    return {
        "step_ms": {s: 1e3 * statistics.mean(r[s]["step_s"] for r in later) for s in SCHEDULES},
        "speedup_median": statistics.median(pairs),
        "speedup_pairs": pairs,
        "idle_share": idle,
        "priced_speedup_median": statistics.median(p / z for p, z in zip(plain, zb, strict=True)),
        "step_over_priced_median": statistics.median(r["zb-h1"]["step_s"] / z for r, z in zip(later, zb, strict=True)),
        "weight_share_median": statistics.median(share),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="steps per schedule (the first is left out)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the width-512 model")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--prepare", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prepare:
        print(json.dumps(prepare(Path(args.prepare), args.layers, documents=256)))
        return 0
    if args.worker:
        _worker(args.worker, args.steps)
        return 0
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first is left out)")
    import torch

    from sparsebalance.results import markdown_table, write_results

    load0 = os.getloadavg()[0]
    rows = run(args.steps, args.layers)
    s = summarise(rows)
    table = markdown_table(
        ["schedule", "step ms (mean)", "stages idle"],
        [[k, f"{s['step_ms'][k]:.0f}", f"{100 * s['idle_share'][k]:.1f} %"] for k in SCHEDULES],
    )
    pairs = ", ".join(f"{x:.3f}" for x in s["speedup_pairs"])
    notes = (
        f"ZB-H1 over 1F1B, measured: **{s['speedup_median']:.3f}x** (median of {len(s['speedup_pairs'])} step "
        f"pairs: {pairs}).\n"
        f"Priced from the ZB-H1 steps' own measured ops: {s['priced_speedup_median']:.3f}x; the measured ZB-H1 step "
        f"is {s['step_over_priced_median']:.3f}x its ops' ZB-H1 makespan; W is "
        f"{100 * s['weight_share_median']:.0f} % of the backward (median).\n\n"
        f"1-min load {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (2 processes).\n\n"
        + __doc__.split("\n\n", 2)[2]
    )
    md, _ = write_results(
        args.out, "pipeline-zero-bubble", torch.device("cpu"), table, {"summary": s, "steps": rows}, notes
    )
    print(table)
    print(notes.split("\n\n")[0])
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
