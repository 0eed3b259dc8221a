"""Exposed gradient reduction after the last backward at DP 2 x PP 2 (issue 54, item 3).

    PYTHONPATH=src python benchmarks/pipeline_overlap.py --before /tmp/before/src [--after /tmp/after/src]

What runs: ``sparsebalance train``'s trainer on 4 gloo processes (DP 2 x PP 2, fp32, CPU, one
thread each), ``--parallel ddp`` and ``--parallel fsdp2``, on an 8-layer model of width 512 with a
4,096-token tied vocabulary (the tiny model's shape family, 27 M parameters, so the reduction
is large enough to time), 8 documents of 150-400 tokens per step, ``--capacity 512``, DST off.
Each run is a fresh set of processes; runs alternate between ``--before`` (a source tree of the
earlier code, e.g. ``git archive <commit> src | tar -x -C /tmp/before``, its ``src`` on
``PYTHONPATH``) and ``--after`` (default: this checkout's ``src``), ``--rounds`` times.

Measured: per step, the trainer's ``sync_s``: from the slowest pipeline's gradients being ready
(its schedule's end: the last backward done and the sends settled) to its gradients being
reduced on every stage. It is the reduction's time that no backward hides. Step 1 (which builds
the optimizer state) is left out; the figure is the mean over steps 2..N of the pipelines' mean.
Also reported: the step's wall time, which says whether the time moved rather than vanished.
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

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1536,
}
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def prepare(root: Path, layers: int = SHAPES["num_hidden_layers"], documents: int = 64) -> dict:
    """The model (width 512, ``layers`` decoder layers), ``documents`` of 150-400 words and an
    analytic profile in ``root``; their paths."""
    from sparsebalance.latency import analytic_profile
    from sparsebalance.models import load_shapes

    base = json.loads((ROOT / "src/sparsebalance/models/configs/tiny.json").read_text())
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    shapes = {**SHAPES, "num_hidden_layers": layers}
    (model / "config.json").write_text(json.dumps({k: v for k, v in base.items() if not k.startswith("_")} | shapes))
    with (root / "data.jsonl").open("w") as f:
        for d in range(documents):
            n = 150 + (d * 37) % 250
            f.write(json.dumps({"text": " ".join(WORDS[(d + i) % len(WORDS)] for i in range(n))}) + "\n")
    analytic_profile(load_shapes(str(model)), "h100", block_size=32).save(root / "profile.json")
    return {"model": str(model), "data": str(root / "data.jsonl"), "profile": str(root / "profile.json")}


def train_config(files: dict, out: str, steps: int, **over):
    """The trainer's setting of these pipeline benchmarks: PP 2 of ``files``' model and data,
    fp32 CPU, 8 documents a step at ``--capacity 512``, DST off, deterministic; ``over``: the rest."""
    from sparsebalance.train import TrainConfig
    from sparsebalance.tuning import DSTConfig

    fields = dict(
        model=files["model"],
        data=files["data"],
        profile=files["profile"],
        out=out,
        steps=steps,
        global_batch=8,
        capacity=512,
        device="cpu",
        block_size=32,
        pp=2,
        strategy="sab",
        dst=DSTConfig(mode="off", budget="gamma", gamma0=0.9),
        checkpoint_every=0,
        deterministic=True,
    )
    return TrainConfig(**{**fields, **over})


def _rank(rank: int, root: str, parallel: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from sparsebalance.engine.runtime import Runtime
    from sparsebalance.train import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=rank, world_size=4)
    files = json.loads(Path(root, "files.json").read_text())
    cfg = train_config(files, f"{root}/run", steps, parallel=parallel)
    trainer = Trainer(cfg, Runtime(rank, 4, torch.device("cpu")))
    rows = []
    for _ in range(steps):
        result = trainer.run_step()
        rows.append({"sync_s": [r.sync_s for r in result.records], "step_s": result.report.step_seconds})
    if rank == 0:
        Path(root, "steps.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _worker(root: str, parallel: str, steps: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(root, parallel, steps), nprocs=4, join=True)


def run_once(src: Path, parallel: str, steps: int) -> list[dict]:
    """One fresh set of 4 processes running the code in ``src``; per step, sync and step time."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": f"{src}:{ROOT}", "OMP_NUM_THREADS": "1"}
        files = subprocess.run(
            [sys.executable, __file__, "--prepare", tmp], env=env, check=True, capture_output=True, text=True
        )
        Path(tmp, "files.json").write_text(files.stdout)
        cmd = [sys.executable, __file__, "--worker", tmp, "--parallel", parallel, "--steps", str(steps)]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(Path(tmp, "steps.json").read_text())


def summarise(rows: list[dict]) -> dict:
    later = rows[1:]
    return {
        "sync_ms": 1e3 * statistics.mean(statistics.mean(r["sync_s"]) for r in later),
        "step_ms": 1e3 * statistics.mean(r["step_s"] for r in later),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=False, help="the earlier code's src folder (a git worktree's src)")
    ap.add_argument("--after", help="the code measured after (default: this checkout's src)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--prepare", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--parallel", default="ddp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prepare:
        print(json.dumps(prepare(Path(args.prepare))))
        return 0
    if args.worker:
        _worker(args.worker, args.parallel, args.steps)
        return 0
    if not args.before:
        ap.error("--before is required (the earlier code's src folder)")
    import torch

    from sparsebalance.results import markdown_table, write_results

    load_start = os.getloadavg()[0]
    code = {"before": Path(args.before), "after": Path(args.after) if args.after else ROOT / "src"}
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for parallel in ("ddp", "fsdp2"):
            for label, src in code.items():
                summary = summarise(run_once(src, parallel, args.steps))
                runs.setdefault((parallel, label), []).append(summary)
                print(f"round {r + 1} {parallel} {label}: {json.dumps(summary)}", file=sys.stderr, flush=True)
    load_end = os.getloadavg()[0]
    rows, payload = [], {"runs": {f"{p}/{label}": v for (p, label), v in runs.items()}}
    for parallel in ("ddp", "fsdp2"):
        before = statistics.median(s["sync_ms"] for s in runs[(parallel, "before")])
        after = statistics.median(s["sync_ms"] for s in runs[(parallel, "after")])
        step_b = statistics.median(s["step_ms"] for s in runs[(parallel, "before")])
        step_a = statistics.median(s["step_ms"] for s in runs[(parallel, "after")])
        rows.append([parallel, before, after, after / before, step_b, step_a])
        payload[parallel] = {
            "exposed_before_ms": before,
            "exposed_after_ms": after,
            "ratio": after / before,
            "step_before_ms": step_b,
            "step_after_ms": step_a,
        }
    headers = ["parallel", "exposed before ms", "exposed after ms", "after / before", "step before ms", "step after ms"]
    table = markdown_table(headers, rows)
    notes = (
        __doc__.split("\n\n", 2)[2]
        + f"\nMedians over {args.rounds} runs each. 1-min load: {load_start:.2f} at the start, "
        f"{load_end:.2f} at the end (4 processes on this machine's cores during the runs)."
    )
    payload |= {"load_start": load_start, "load_end": load_end, "rounds": args.rounds, "steps": args.steps}
    md, _ = write_results(args.out, "pipeline-overlap", torch.device("cpu"), table, payload, notes)
    print(table)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
