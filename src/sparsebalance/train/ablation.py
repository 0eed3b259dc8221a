"""The four-way ablation (baseline / SAB / DST / SAB+DST) measured with the real trainer on the
same samples, next to the simulator's prediction for the same batches (``bench-e2e``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from ..batching import HistoryEstimator
from ..data import load_corpus, load_tokenizer
from ..data.batches import BatchSource
from ..latency import LatencyModel, context_cost, load_profile
from ..report import load_run, summarize
from ..simulate import ABLATIONS, simulate_steps
from .checkpoint import latest_checkpoint, load_state
from .config import TrainConfig
from .launch import launch

ABLATION = ("baseline", "sab", "dst", "sab+dst")
"""The runs ``bench-e2e`` measures by default; each name's planner strategy and DST mode come from
the simulator's :data:`~sparsebalance.simulate.ABLATIONS` (one table for both)."""
HYBRID = ("sab+cp", "sab+cp+dst")
"""The hybrid data x context parallel runs (``--strategy sab-cp``: long documents trained whole
over CP units), measured when named in ``--strategies``."""


def ablation_configs(cfg: TrainConfig, names: list[str]) -> dict[str, TrainConfig]:
    """One training configuration per ablation name (``baseline`` always first), each writing to
    its own folder under ``cfg.out``."""
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise ValueError(f"--strategies: unknown {unknown}; allowed: {', '.join(ABLATIONS)}")
    out = {}
    for name in ["baseline", *[n for n in names if n != "baseline"]]:
        s = ABLATIONS[name]
        dst = replace(cfg.dst, mode=s.dst_mode, anchor=s.anchor or cfg.dst.anchor)
        out[name] = replace(
            cfg, strategy=s.planner, dst=dst, overwrite=True, out=str(Path(cfg.out) / name.replace("+", "_"))
        )
    return out


def measure(configs: dict[str, TrainConfig], nproc: int, reuse: bool = False) -> dict[str, dict]:
    """Train every configuration (``reuse``: read runs already there); summaries from their
    metrics.jsonl (step 1 excluded)."""
    out = {}
    for name, cfg in configs.items():
        if not reuse:
            launch(cfg, nproc)
        _, steps = load_run(Path(cfg.out))
        out[name] = summarize(steps)
    return out


def _trainer_state(run_dir: Path) -> dict | None:
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None
    return load_state(ckpt)["trainer"]  # checksums verified; unreadable -> ValueError


def predict(
    cfg: TrainConfig,
    names: list[str],
    world_size: int,
    baseline_dir: Path,
    hybrid_dir: Path | None = None,
) -> dict:
    """The simulator on the same global batches, with the latency model of the measured baseline
    run (its profile, recalibrated online to its final step) and the estimator's starting
    densities (what the first plan sees; no step-level coverage information, as in the trainer,
    whose layers enforce the coverage bound). Every strategy sees it through the trainer's
    ``ContextCost`` (``sab-cp`` prices split documents with it; the others read only the base
    model); its multi-rank terms (shard compute, ring imbalance, transfer scale) are those the
    measured hybrid run ``hybrid_dir`` recalibrated up to its final step, where given."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    corpus = load_corpus(
        cfg.data,
        tokenizer,
        cfg.text_field,
        cfg.num_builtin,
        cfg.seed,
        cfg.min_len,
        cfg.max_len,
        on_bad_record=cfg.on_bad_record,
    )
    latency = LatencyModel(load_profile(baseline_dir / "latency_profile.json"))
    state = _trainer_state(baseline_dir)
    if state is not None:
        latency.load_state_dict(state["latency"])
    cost = trainer_cost(latency, cfg)
    hybrid = _trainer_state(hybrid_dir) if hybrid_dir is not None else None
    if hybrid is not None and hybrid.get("context") is not None:
        cost.load_state_dict(hybrid["context"])
    estimator = HistoryEstimator()
    batches = []
    source = BatchSource(corpus, cfg.seed, cfg.global_batch)  # the trainer's batches
    for _ in range(cfg.steps):
        samples = source.next_batch()
        batches.append((np.array([s.num_tokens for s in samples]), estimator.estimate(samples)))
    out = simulate_steps(
        batches[1:] or batches,
        world_size,
        cost,
        micro_batches=cfg.micro_batches,
        capacity=cfg.capacity,
        strategies=names,
        dst=cfg.dst,
        overlong=cfg.overlong,
        block_size=cfg.block_size,
        coverage=False,
    )
    out["context_cost"] = cost.describe()
    return out


def trainer_cost(latency: LatencyModel, cfg: TrainConfig, ranks_per_node: int | None = None):
    """The ``ContextCost`` the trainer plans ``sab-cp`` with: links measured in the profile, else
    the analytic H100 ones; K/V sizes from the profile's model shapes; nodes of
    ``ranks_per_node`` ranks (the run's ``Topology``; default: the links' own)."""
    cost = context_cost(latency, "h100", block_size=cfg.block_size)
    return cost if ranks_per_node is None else cost.on_nodes(ranks_per_node)
