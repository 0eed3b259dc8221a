"""MTraining's context-parallel setting in our cost model, beside MTraining's published ratios.

Setting (MTraining, arXiv 2510.18830): Qwen2.5-3B, one 512K-token document, 32 A100 GPUs (4 nodes
x 8, NVLink inside a node, InfiniBand across), attention density about 5 %. Four variants, each a
single CP unit of k = 32 ranks priced by :class:`~sparsebalance.latency.context.ContextCost` on
the analytic A100 profile (GEMM 45 %, attention 35 % of peak) and analytic A100 links:

- dense zigzag ring (density 1.0, flat ring, zigzag placement);
- sparse zigzag ring (density 0.05, flat ring, zigzag placement);
- sparse striped ring (density 0.05, flat ring, striped placement);
- sparse striped hierarchical ring (density 0.05, inner rings of 8 inside a node).

The placement's ring imbalance comes from ``ring_work`` on an *estimated* vertical-slash layout of
one document (``parallel.imbalance.estimate_ring_imbalance``, coarsened to ``--blocks`` blocks so
it fits in memory), not from the calibrated default. Speed-ups are the dense zigzag time over each
variant's, per training step of that document (forward + backward, all layers).

    PYTHONPATH=src .venv/bin/python benchmarks/mtraining_setting.py [--blocks 2048]
"""

from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from sparsebalance.latency import LatencyModel, analytic_links, analytic_profile
from sparsebalance.latency.context import ContextCost
from sparsebalance.models import load_shapes
from sparsebalance.parallel.imbalance import estimate_ring_imbalance
from sparsebalance.results import markdown_table, write_results

OUT = Path(__file__).parent / "results"
LENGTH, RANKS, DENSITY, PER_NODE = 524288, 32, 0.05, 8
# MTraining's reported end-to-end speed-ups over the dense zigzag ring (their Fig./Sec. on
# distributed sparse attention): up to 6x with striped + hierarchical, 4.6x striped without the
# hierarchical ring, 2.9x with zigzag.
PUBLISHED = {"dense zigzag": 1.0, "sparse zigzag": 2.9, "sparse striped": 4.6, "sparse striped hierarchical": 6.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2048, help="layout blocks for the imbalance")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    shapes = load_shapes("qwen2.5-3b")
    model = LatencyModel(analytic_profile(replace(shapes, max_context=LENGTH), "a100", block_size=128))
    links = analytic_links("a100")
    est_block = LENGTH // args.blocks
    imb = {
        "zigzag dense": estimate_ring_imbalance(LENGTH, 1.0, RANKS, "zigzag", block_size=est_block),
        "zigzag": estimate_ring_imbalance(LENGTH, DENSITY, RANKS, "zigzag", block_size=est_block),
        "striped": estimate_ring_imbalance(LENGTH, DENSITY, RANKS, "striped", block_size=est_block),
        "striped hier": estimate_ring_imbalance(
            LENGTH, DENSITY, RANKS, "striped", block_size=est_block, inner_size=PER_NODE
        ),
    }
    variants = [
        ("dense zigzag", 1.0, "flat", imb["zigzag dense"]),
        ("sparse zigzag", DENSITY, "flat", imb["zigzag"]),
        ("sparse striped", DENSITY, "flat", imb["striped"]),
        ("sparse striped hierarchical", DENSITY, "hierarchical", imb["striped hier"]),
    ]
    rows, payload, base = [], {}, None
    for name, d, ring, factor in variants:
        cost = ContextCost.for_shapes(
            model, shapes, links, block_size=128, ring=ring, imbalance_flat=factor, imbalance_hier=factor
        )
        t, comm = cost.unit_seconds(np.array([LENGTH]), np.array([d]), np.array([RANKS]))
        one, _ = cost.unit_seconds(np.array([LENGTH]), np.array([d]), np.array([1]))
        base = base or float(t[0])
        rows.append(
            [name, factor, float(t[0]), float(comm[0]), base / float(t[0]), PUBLISHED[name], float(one[0]) / RANKS]
        )
        payload[name] = {
            "imbalance": factor,
            "seconds": float(t[0]),
            "comm": float(comm[0]),
            "speedup": base / float(t[0]),
            "published": PUBLISHED[name],
        }
    table = markdown_table(
        [
            "variant",
            "ring imbalance (estimated layout)",
            "step s per rank",
            "exposed comm s",
            "speed-up vs dense zigzag (ours)",
            "MTraining (published)",
            "ideal s (1 rank / 32)",
        ],
        rows,
    )
    crossover = ContextCost.for_shapes(model, shapes, links, block_size=128).crossover(LENGTH, DENSITY, 256)
    load = os.getloadavg()
    text = (
        f"## MTraining's setting: Qwen2.5-3B, one {LENGTH:,}-token document, {RANKS} A100 "
        f"(analytic), density {DENSITY}\n\n{table}\n\n"
        f"Imbalance estimated on a vertical-slash layout of {args.blocks} blocks "
        f"({est_block} tokens per block). Lowest per-rank time over k <= 256 for this "
        f"document (striped, auto ring): k = {crossover}.\n\nLoad average {load[0]:.1f} "
        "(2 shared cores; these are computed predictions, not timings).\n"
    )
    notes = (
        "Where the models differ: (1) ours is a cost model (analytic FLOP counts at fixed "
        "efficiencies, analytic NVLink 300 GB/s / IB 22.5 GB/s), theirs a measurement; (2) we "
        "price dense and sparse attention at the same 35 % of peak, while their dense baseline is "
        "FlashAttention and their sparse kernel reaches a lower fraction of peak; (3) the ring "
        "overlaps each step's transfer with its compute (per step max(compute, transfer)): at "
        "3B / 512K / 5 % the flat ring across 4 nodes exposes the inter-node transfers shown in "
        "the table, which the hierarchical ring hides, but its outer/inner schedule costs "
        "balance on the estimated layout (imbalance column), so the two come out close in our "
        "model while MTraining measures 4.6x -> 6x; (4) our imbalance comes from a synthetic "
        "vertical-slash layout, theirs from real attention; (5) the token-proportional rest "
        "(MLP, projections, head) is in every "
        "variant's step, which caps the speed-up of sparse attention."
    )
    md, js = write_results(
        OUT,
        "mtraining-setting",
        torch.device("cpu"),
        text,
        {"variants": payload, "imbalance": imb, "blocks": args.blocks, "crossover_k": crossover},
        notes,
    )
    print(text)
    print(notes)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
