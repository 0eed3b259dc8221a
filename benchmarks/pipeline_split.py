"""How much the layer split of a pipeline matters, simulated in the paper's Table I setting
(Qwen2.5-3B, analytic H200, block 256, top-k 8,192 tokens, PP4, micro-batch 2, 4 micro-batches per
pipeline; the ChatQA2-like and LongAlign-like mixes of ``benchmarks/configs/table1.toml``).

    python benchmarks/pipeline_split.py            # writes benchmarks/results/
    python benchmarks/pipeline_split.py --quick    # 50 pipelines, writes nothing

For each mix, the mean exact 1F1B makespan of ``--pipelines`` random pipelines (documents in
drawn order, two per micro-batch, each at the top-k budget's density) under:

- the even split (``stage_layers``: 9/9/9/9);
- the trainer's split (``balanced_layers`` with the head weighed by FLOPs from the shapes,
  ``head_layers``: 10/10/10/6);
- the split balanced with the head weighed by the latency model instead (its head seconds over a
  layer's seconds, attention included, on these pipelines);
- the split of least mean makespan over every split of the layers into P non-empty stages
  (exhaustive: C(L-1, P-1) splits).

Deterministic (seeded draws, no timing). Times are the latency model's predictions, not
measurements.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import tomllib
import torch

sys.path.insert(0, str(Path(__file__).parent))
from sparsebalance.batching.schedule import (
    balanced_layers,
    head_layers,
    head_seconds,
    layered_makespans,
    stage_layers,
)
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.ops.budget import topk_density
from sparsebalance.results import markdown_table, write_results
from table1 import CONFIG, draw_lengths

STAGES, MICRO_BATCHES, DOCS_PER_MICRO_BATCH = 4, 4, 2


def setting() -> tuple[dict, LatencyModel, object]:
    cfg = tomllib.loads(CONFIG.read_text())
    s = cfg["simulated"]
    shapes = load_shapes(s["model"])
    longest = max(max(mx["long"][1], mx["short"][1]) for mx in s["mixes"].values())
    grid = replace(shapes, max_context=max(shapes.max_context, longest * s["samples_per_rank"] // 2 + 1))
    return s, LatencyModel(analytic_profile(grid, s["accelerator"], block_size=s["block_size"])), shapes


def pipelines(s: dict, model: LatencyModel, mix: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(n, M)`` predicted seconds of each micro-batch and ``(n, M)`` its head seconds."""
    rng = np.random.default_rng([27, 44, n])
    lengths = draw_lengths(s["mixes"][mix], n * MICRO_BATCHES * DOCS_PER_MICRO_BATCH, rng)
    dens = topk_density(lengths, s["budget_tokens"] // s["block_size"], s["block_size"])
    lengths, dens = lengths.reshape(-1, DOCS_PER_MICRO_BATCH), dens.reshape(-1, DOCS_PER_MICRO_BATCH)
    totals = model.predict_many(lengths, dens)
    head = head_seconds(model, lengths, dens, totals)
    return totals.reshape(n, MICRO_BATCHES), head.reshape(n, MICRO_BATCHES)


def mean_makespans(times: np.ndarray, head: np.ndarray, splits: list[tuple[int, ...]]) -> np.ndarray:
    return np.array([layered_makespans(times, head, np.array(sp)).mean() for sp in splits])


def compare(s: dict, model: LatencyModel, shapes, mix: str, n: int) -> list[dict]:
    layers = model.num_layers
    times, head = pipelines(s, model, mix, n)
    weight = float(head.sum() / ((times - head).sum() / layers))  # the head in layers, as priced
    every = [(*c, layers - sum(c)) for c in itertools.product(range(1, layers), repeat=STAGES - 1)]
    every = [c for c in every if c[-1] >= 1]
    spans = mean_makespans(times, head, every)
    named = {
        "even": tuple(stage_layers(layers, STAGES).tolist()),
        f"trainer's (head {head_layers(shapes):.2f} layers, FLOPs)": tuple(
            balanced_layers(layers, STAGES, head_layers(shapes)).tolist()
        ),
        f"head {weight:.2f} layers (latency model)": tuple(balanced_layers(layers, STAGES, weight).tolist()),
        f"least makespan (of {len(every):,})": every[int(np.argmin(spans))],
    }
    ref = float(spans[every.index(named[list(named)[1]])])
    return [
        {"mix": mix, "split": name, "layers": "/".join(map(str, sp)), "makespan_ms": 1e3 * spans[every.index(sp)]}
        | {"vs_trainer": float(spans[every.index(sp)]) / ref}
        for name, sp in named.items()
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pipelines", type=int, default=400, help="random pipelines per mix (default 400)")
    p.add_argument("--quick", action="store_true", help="50 pipelines, no results file")
    p.add_argument("--out", default="benchmarks/results", help="results folder")
    args = p.parse_args()
    n = 50 if args.quick else args.pipelines
    s, model, shapes = setting()
    rows = [r for mix in s["mixes"] for r in compare(s, model, shapes, mix, n)]
    table = markdown_table(
        ["mix", "split", "layers per stage", "mean makespan (ms)", "vs the trainer's split"],
        [[r["mix"], r["split"], r["layers"], r["makespan_ms"], r["vs_trainer"]] for r in rows],
    )
    print(table)
    if not args.quick:
        notes = (
            f"Run as `python benchmarks/pipeline_split.py`. {n} random pipelines per mix, PP{STAGES}, "
            f"{MICRO_BATCHES} micro-batches of {DOCS_PER_MICRO_BATCH} documents in drawn order, top-k "
            f"{s['budget_tokens']:,} tokens; exact 1F1B makespans of the latency model's "
            "predictions (analytic H200), backward = 2 x forward. Simulated, not measured."
        )
        md, js = write_results(args.out, "pipeline-split", torch.device("cpu"), table, {"rows": rows}, notes)
        print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
