"""Memory: the memory model's predictions against measured CPU peaks, and what it predicts on GPUs.

    PYTHONPATH=src python benchmarks/memory.py --raw /tmp/memb [--date 2026-11-23]

Part 1 (measured, CPU). A 2-layer model of Qwen2.5-0.5B's width with its full 151,936-token
vocabulary, fp32, one document per micro-batch (block-sparse attention, gamma 0.9, density cap
0.1). Every configuration runs ``benchmarks/memory_probe.py`` in a fresh process (sequentially;
``--raw DIR`` keeps their JSON, and configurations already there are reused) and its peak RSS is
compared with ``MemoryModel.peak_bytes``. The model's only measured input is the resident size of a
fresh process with the libraries imported (its ``base``); everything else is counted from shapes.
Configurations whose *predicted* peak exceeds ``--max-gib`` are predicted, not run.

Part 2 (predicted, GPUs). The analytic model's longest trainable document for Qwen2.5-0.5B and 3B
on one 80 GB GPU and on 32 with context parallelism, and MTraining's setting (3B, 512K tokens,
32 A100-80GB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

from sparsebalance.latency.memory import ANALYTIC, GIB, MemoryConfig, MemoryModel, cpu_coefficients
from sparsebalance.latency.memory_bound import with_budget_fraction
from sparsebalance.models import load_shapes
from sparsebalance.results import markdown_table

HERE = Path(__file__).parent
CONFIGS = [  # (tokens, checkpointing, loss)
    (1024, "full", "chunked"),
    (2048, "off", "plain"),
    (2048, "full", "plain"),
    (4096, "off", "chunked"),
    (4096, "full", "chunked"),
    (8192, "off", "chunked"),
    (8192, "full", "chunked"),
    (16384, "off", "chunked"),
    (16384, "full", "chunked"),
    (16384, "selective", "chunked"),
    (16384, "off", "plain"),
]


def measure_base() -> int:
    """Resident bytes of a fresh process that imported what the probe runs (with transformers'
    Qwen2 modelling code, which ``build_model`` imports)."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import memory_probe as m; "
        "import transformers.models.qwen2.modeling_qwen2; print(m.current_rss())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def probe(raw: Path, tokens: int, ckpt: str, loss: str, run: bool) -> dict | None:
    out = raw / f"T{tokens}-{ckpt}-{loss}.json"
    if not out.exists():
        if not run:
            return None
        cmd = [
            sys.executable,
            str(HERE / "memory_probe.py"),
            "--tokens",
            str(tokens),
            "--checkpointing",
            ckpt,
            "--loss",
            loss,
            "--out",
            str(out),
        ]
        subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def cpu_part(args) -> tuple[list[dict], dict]:
    raw = Path(args.raw)
    raw.mkdir(parents=True, exist_ok=True)
    base = measure_base()
    shapes = replace(load_shapes("qwen2.5-0.5b"), num_layers=2)
    model = MemoryModel(shapes, cpu_coefficients(base))
    rows = []
    for tokens, ckpt, loss in CONFIGS:
        cfg = MemoryConfig(ckpt, loss, density=0.1, block_size=64)
        pred = model.peak_bytes(tokens, cfg)
        row = {"tokens": tokens, "checkpointing": ckpt, "loss": loss, "predicted_gib": pred / GIB}
        r = None if pred > args.max_gib * GIB else probe(raw, tokens, ckpt, loss, not args.no_run)
        if r is None:
            why = "over --max-gib" if pred > args.max_gib * GIB else "not run (time)"
            row.update(measured_gib=None, error=None, seconds=None, moment=why)
        else:
            row.update(
                measured_gib=r["peak_rss"] / GIB,
                seconds=r["seconds"],
                error=pred / r["peak_rss"] - 1,
                moment=model.breakdown(tokens, cfg)["moment"],
            )
        rows.append(row)
    measured = [r for r in rows if r["error"] is not None]
    by = {(r["tokens"], r["checkpointing"], r["loss"]): r for r in rows}
    best, worst = by[(16384, "full", "chunked")], by[(16384, "off", "plain")]
    summary = {
        "base_gib": base / GIB,
        "num_measured": len(measured),
        "max_abs_error": max(abs(r["error"]) for r in measured) if measured else None,
        "mean_abs_error": sum(abs(r["error"]) for r in measured) / max(1, len(measured)),
        "ratio_16k_ckpt_chunked_vs_neither_predicted": best["predicted_gib"] / worst["predicted_gib"],
        "ratio_16k_ckpt_chunked_measured_vs_neither_predicted": (
            best["measured_gib"] / worst["predicted_gib"] if best["measured_gib"] else None
        ),
    }
    for t in (8192, 16384):
        on, off = by.get((t, "full", "chunked")), by.get((t, "off", "chunked"))
        if on and off and on["seconds"] and off["seconds"]:
            summary[f"checkpointing_time_ratio_{t}"] = on["seconds"] / off["seconds"]
    return rows, summary


def gpu_part() -> tuple[list[dict], list[dict]]:
    rows = []
    for name in ("qwen2.5-0.5b", "qwen2.5-3b"):
        for acc in ("h100", "a100"):
            mem = MemoryModel(load_shapes(name), ANALYTIC[acc])
            budget = with_budget_fraction(ANALYTIC[acc])
            for ckpt, loss in (("off", "plain"), ("selective", "chunked"), ("full", "chunked")):
                base = MemoryConfig(ckpt, loss, block_size=128, density=0.1)
                rows.append(
                    {
                        "model": name,
                        "gpu": acc,
                        "checkpointing": ckpt,
                        "loss": loss,
                        "1 GPU": mem.max_tokens(budget, base),
                        "32 GPUs, CP 32 + FSDP2": mem.max_tokens(budget, replace(base, shard=32, cp=32)),
                    }
                )
    mem = MemoryModel(load_shapes("qwen2.5-3b"), ANALYTIC["a100"])
    budget = with_budget_fraction(ANALYTIC["a100"])
    mtraining = []
    for ckpt, loss in (
        ("off", "plain"),
        ("off", "chunked"),
        ("selective", "chunked"),
        ("full", "plain"),
        ("full", "chunked"),
    ):
        parts = mem.breakdown(524288, MemoryConfig(ckpt, loss, shard=32, cp=32, block_size=128, density=0.1))
        mtraining.append(
            {
                "checkpointing": ckpt,
                "loss": loss,
                "peak_gib": parts["peak"] / GIB,
                "fits": parts["peak"] <= budget,
                "moment": parts["moment"],
                "activations_gib": parts["activations"] / GIB,
                "loss_gib": parts["loss"] / GIB,
                "attention_gib": parts["attention workspace"] / GIB,
            }
        )
    return rows, mtraining


def _table(rows: list[dict], fmt=lambda v: f"{v:.2f}" if isinstance(v, float) else v) -> str:
    headers = list(rows[0])
    return markdown_table(headers, [[("-" if r[h] is None else fmt(r[h])) for h in headers] for r in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--raw", default="benchmarks/results/memory-raw")
    p.add_argument("--max-gib", type=float, default=8.0, help="predict, don't run, above this")
    p.add_argument("--no-run", action="store_true", help="use only the probes already in --raw")
    p.add_argument("--date", default=date.today().isoformat())
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args()
    load = Path("/proc/loadavg").read_text().split()[:3]
    t0 = time.time()
    cpu_rows, summary = cpu_part(args)
    gpu_rows, mtraining = gpu_part()
    stem = Path(args.out) / f"{args.date}-memory-cpu"
    payload = {
        "command": " ".join(sys.argv),
        "load_before": load,
        "load_after": Path("/proc/loadavg").read_text().split()[:3],
        "summary": summary,
        "cpu": cpu_rows,
        "gpu": gpu_rows,
        "mtraining": mtraining,
        "wall_seconds": time.time() - t0,
    }
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    md = [
        f"# Memory model vs measured peaks (CPU) and predicted GPU limits — {args.date}",
        "",
        f"Command: `PYTHONPATH=src python {' '.join(sys.argv)}`",
        f"Machine: 2 shared CPU cores, 24 GB RAM; load average {' '.join(load)} before and "
        f"{' '.join(payload['load_after'])} after. Other engineers' jobs were running on the "
        "machine throughout: times are noisy (one run each).",
        "",
        "## Measured peak RSS vs predicted (2-layer Qwen2.5-0.5B width, V = 151,936, fp32)",
        "",
        _table(cpu_rows),
        "",
        "```json",
        json.dumps(summary, indent=1),
        "```",
        "",
        "## Predicted longest document (tokens), analytic bf16, budget 90% of the GPU",
        "",
        _table(gpu_rows),
        "",
        "## MTraining's setting: Qwen2.5-3B, 524,288 tokens, 32 A100-80GB (CP 32 + FSDP2)",
        "",
        _table(mtraining),
    ]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
