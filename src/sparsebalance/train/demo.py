"""``train --demo``'s two runs: the baseline and SparseBalance on the same data, seed and steps,
stepped in turn by the same ranks (:func:`~.launch.launch`'s ``together``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .config import TrainConfig, earlier_run

DEMO_DEFAULTS = {"capacity": 2100, "out": "runs/demo", "dst": {"budget_tokens": 512}}
"""What ``--demo`` changes from ``sparsebalance train``'s defaults (flags and ``--config`` still
win): the built-in data (256 documents, 128..4,103 tokens) with a capacity of 2,100 tokens, so
5 documents are longer than the capacity (the longest, 4,103 tokens, about 2x it): the baseline
cuts them (``--overlong split``), SparseBalance trains them whole on a unit of both ranks. Its
own folder (``runs/demo``): a plain run's ``runs/train`` is never mixed into its report. The
top-k base budget is 512 tokens (k = 8 blocks of 64): the paper's 8,192 covers every document
this CPU trains, so attention would be exact; 512 is the same share of a 4K document as 8,192
of the paper's 64K ones."""
DEMO_CPU_RANKS = 2
"""Ranks of the demo on CPU: one per core of a 2-core machine. With more processes than cores a
rank that waits frees its core for the others, so balance stops showing in step time (measured:
4 ranks on 2 cores, 0.96x, benchmarks/results/2026-11-24-train-demo-4ranks-cpu.md);
``--nproc 4 --capacity 1368`` trains a document 3x the capacity whole on 3 ranks."""


def demo_configs(cfg: TrainConfig) -> dict[str, TrainConfig]:
    """The two runs of the demo: same data, seed and steps; only batching and tuning differ:
    the baseline (dataset order, a fixed budget, over-long documents cut by ``--overlong``) and
    SparseBalance (SAB + CP + DST: ``sab-cp`` plans, long documents trained whole over units of
    ranks; with ``--pp``, SAB + DST: a pipeline runs whole documents per micro-batch). They are
    scratch runs: a new demo replaces the previous one's folders. :func:`~.launch.launch` steps them in
    turn on the same ranks (``together``)."""
    from ..simulate import ABLATIONS  # the one ablation table (planner, DST mode per name)

    root = Path(cfg.out)
    if earlier_run(root):
        raise ValueError(
            f"--out {root} holds a training run; --demo writes its two runs and their report "
            "into its own folder: choose another --out (default runs/demo)"
        )

    ours = ABLATIONS["sab+cp+dst"] if cfg.pp == 1 else ABLATIONS["sab+dst"]
    runs = {"baseline": ABLATIONS["baseline"], "sparsebalance": ours}
    return {
        name: replace(
            cfg,
            strategy=s.planner,
            dst=replace(cfg.dst, mode=s.dst_mode),
            out=str(Path(cfg.out) / name),
            overwrite=True,
        )
        for name, s in runs.items()
    }
