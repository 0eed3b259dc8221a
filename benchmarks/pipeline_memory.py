"""Memory of pipeline stages: the memory model's peak per stage against each stage's measured peak.

    PYTHONPATH=src python benchmarks/pipeline_memory.py [--tokens 1024,2048] [--out benchmarks/results]

What runs: ``sparsebalance train``'s trainer at ``--pp 2`` on 2 gloo processes (DP 1, fp32, CPU),
one fresh pair of processes per configuration, on a 4-layer model of Qwen2.5-0.5B's width with a
32,768-token vocabulary (a tied head) so that a step runs in seconds on this CPU. Its stages are
split as the trainer splits them (3 + 1 layers: the head weighs ~2 layers), so the first stage
runs 3 layers and keeps 2 micro-batches in flight, the second 1 layer, the head and the loss.
Every document is longer than the capacity ``T``, so ``--overlong split`` makes each micro-batch
``T`` tokens and every step has several micro-batches per pipeline. Each process takes 2 steps
(the first creates AdamW's state, the second is a step like every later one) and reports its
peak resident size (``VmHWM``) before any checkpoint is written.

Predicted: ``MemoryModel.peak_bytes(T, MemoryConfig(..., micro_batches=2, stage=StageShare.of(split,
s)))`` with the CPU coefficients and, as the base, each process's own resident size with the libraries
and transformers' Qwen2 modelling code imported, before the model (as ``benchmarks/memory.py``
measures it): what ``train --capacity auto`` computes for that stage. A stage kept as one micro-batch in
flight (the model before pipelines) is printed beside it. Each configuration also runs at
``--pp 1`` (one process, the whole model, the same micro-batches): the same model's error where
no pipeline is involved, the reference for what the stage accounting adds or removes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.latency.analytic import analytic_profile
from sparsebalance.latency.host_memory import current_rss_bytes, peak_rss_bytes
from sparsebalance.latency.memory import GIB, MemoryConfig, MemoryModel, StageShare, cpu_coefficients
from sparsebalance.models import load_shapes
from sparsebalance.results import markdown_table, write_results

MODES = ("off", "full")
SHAPES = {"num_hidden_layers": 4, "vocab_size": 32768}


def write_model(root: Path) -> Path:
    """The 4-layer, 32K-vocabulary Qwen2.5-0.5B-width model's config directory."""
    base = json.loads((Path(__file__).parents[1] / "src/sparsebalance/models/configs/qwen2.5-0.5b.json").read_text())
    cfg = {k: v for k, v in base.items() if not k.startswith("_")} | SHAPES
    path = root / "model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def write_corpus(root: Path, tokens: int) -> Path:
    """Documents of about 3 x ``tokens`` tokens (split into ``tokens``-token pieces by ``--overlong split``)."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    path = root / "corpus.jsonl"
    with path.open("w") as f:
        for d in range(16):
            f.write(json.dumps({"text": " ".join(words[(d + i) % len(words)] for i in range(3 * tokens))}) + "\n")
    return path


def _worker(rank: int, root: str, tokens: int, ckpt: str, pp: int) -> None:
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (the modelling code the run imports)

    from sparsebalance.engine.runtime import Runtime
    from sparsebalance.train import TrainConfig, Trainer

    root_p = Path(root)
    out = root_p / f"rank{rank}.json"
    base = current_rss_bytes()  # libraries loaded, no model: the memory model's base, as in memory.py
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=rank, world_size=pp)
    torch.set_num_threads(1)
    cfg = TrainConfig(
        model=str(root_p / "model"),
        data=str(root_p / "corpus.jsonl"),
        profile=str(root_p / "profile.json"),
        out=str(root_p / "run"),
        steps=2,
        global_batch=2,
        capacity=tokens,
        overlong="split",
        device="cpu",
        block_size=64,
        pp=pp,
        activation_checkpointing=ckpt,
    )
    trainer = Trainer(cfg, Runtime(rank, pp, torch.device("cpu")))
    units = []
    for _ in range(cfg.steps):
        result = trainer.run_step()
        units.append([u["tokens"] for rec in result.records for u in rec.units])
    peak, source = peak_rss_bytes()
    stage = trainer.stage  # None at --pp 1
    where = {"split": list(stage.split), "stage": stage.layout.stage} if stage is not None else {}
    out.write_text(json.dumps({"base": base, "peak": peak, "source": source, "units": units} | where))
    dist.destroy_process_group()


def measure(root: Path, tokens: int, ckpt: str, pp: int) -> list[dict]:
    """One fresh set of ``pp`` processes: each stage's base, peak and the step's micro-batch sizes."""
    run = root / f"T{tokens}-{ckpt}-pp{pp}"
    run.mkdir(parents=True, exist_ok=True)
    write_model(run)
    write_corpus(run, tokens)
    analytic_profile(load_shapes(str(run / "model")), "h100", block_size=64).save(run / "profile.json")
    mp.spawn(_worker, args=(str(run), tokens, ckpt, pp), nprocs=pp, join=True)
    return [json.loads((run / f"rank{r}.json").read_text()) for r in range(pp)]


def rows_of(tokens: int, ckpt: str, ranks: list[dict], shapes) -> list[dict]:
    rows = []
    for r in ranks:
        model = MemoryModel(shapes, cpu_coefficients(r["base"]), tied_embeddings=True)
        stage = StageShare.of(tuple(r["split"]), r["stage"]) if "stage" in r else None
        cfg = MemoryConfig(ckpt, "chunked", micro_batches=2, stage=stage, block_size=64)
        pred = model.peak_bytes(tokens, cfg)
        one = stage if stage is None else replace(stage, in_flight=1)
        single = model.peak_bytes(tokens, replace(cfg, stage=one))
        rows.append(
            {
                "tokens": tokens,
                "checkpointing": ckpt,
                "pp": 1 if stage is None else len(r["split"]),
                "stage": "whole" if stage is None else r["stage"],
                "layers": shapes.num_layers if stage is None else stage.layers,
                "in flight": 1 if stage is None else stage.in_flight,
                "micro-batches": [len(u) for u in r["units"]],
                "largest micro-batch": max(max(u) for u in r["units"]),
                "measured GiB": r["peak"] / GIB,
                "predicted GiB": pred / GIB,
                "error": pred / r["peak"] - 1,
                "one in flight GiB": single / GIB,
                "error, one in flight": single / r["peak"] - 1,
                "moment": model.breakdown(tokens, cfg)["moment"],
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,2048", help="micro-batch sizes T, comma-separated")
    ap.add_argument("--root", default="/tmp/pipeline-memory", help="scratch folder for the runs")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    root = Path(args.root)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for ckpt in MODES:
            for pp in (2, 1):
                ranks = measure(root, tokens, ckpt, pp)
                shapes = load_shapes(str(root / f"T{tokens}-{ckpt}-pp{pp}" / "model"))
                rows += rows_of(tokens, ckpt, ranks, shapes)
                print(json.dumps(rows[-pp:]), file=sys.stderr, flush=True)
    summary = {}
    for pp in (2, 1):
        errors = [abs(r["error"]) for r in rows if r["pp"] == pp]
        summary[f"pp{pp}"] = {"max_abs_error": max(errors), "mean_abs_error": sum(errors) / len(errors)}
    headers = list(rows[0])
    table = markdown_table(headers, [[r[h] for h in headers] for r in rows])
    notes = __doc__.split("\n\n", 2)[2] + f"\nSummary: {json.dumps(summary)}"
    md, _ = write_results(args.out, "pipeline-memory", torch.device("cpu"), table, {"rows": rows, **summary}, notes)
    print(table)
    print(f"wrote {md}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
