"""``sparsebalance train``: launch torchrun with the resolved config; ``--demo`` runs the baseline
and SparseBalance on the same samples and compares them."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from .config import TrainConfig, to_dict


def dst_flags(cfg: TrainConfig) -> list[str]:
    d = cfg.dst
    return ["--dst-mode", d.mode, "--anchor", d.anchor, "--tolerance", str(d.p),
            "--gamma0", str(d.gamma0), "--gamma-min", str(d.gamma_min),
            "--gamma-max", str(d.gamma_max), "--dst-probes", str(d.layer_probes)]  # fmt: skip


def uses_cuda(cfg: TrainConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def default_nproc(cfg: TrainConfig, requested: int | None) -> int:
    """Processes to launch: ``--nproc``, else 1 with ``--emulate-ranks``, else the GPU count on
    CUDA and 2 on CPU."""
    if requested:
        return requested
    if cfg.emulate_ranks:
        return 1
    return torch.cuda.device_count() if uses_cuda(cfg) else 2


def launch(cfg: TrainConfig, nproc: int) -> None:
    """Run ``torchrun --standalone --nproc_per_node nproc -m sparsebalance.train`` (or a single
    process when ``nproc == 1``); raises ``RuntimeError`` if training fails."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "launch-config.json"
    values = {k: v for k, v in to_dict(cfg).items() if k != "dst"}
    cfg_path.write_text(json.dumps(values, indent=1) + "\n")
    worker = ["-m", "sparsebalance.train", "--config", str(cfg_path), *dst_flags(cfg)]
    if nproc == 1:
        cmd = [sys.executable, *worker]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *worker]  # fmt: skip
    rc = subprocess.call(cmd)
    if rc != 0:
        raise RuntimeError(f"training exited with code {rc} (command: {' '.join(cmd)})")


def demo_configs(cfg: TrainConfig) -> dict[str, TrainConfig]:
    """The two runs of the demo: same data, seed and steps; only batching and tuning differ.
    They are scratch runs: a new demo replaces the previous one's folders."""
    out = Path(cfg.out)
    return {
        "baseline": replace(cfg, strategy="sequential", dst=replace(cfg.dst, mode="off"),
                            out=str(out / "baseline"), overwrite=True),
        "sparsebalance": replace(cfg, strategy="sab", dst=replace(cfg.dst, mode="bidirectional"),
                                 out=str(out / "sparsebalance"), overwrite=True),
    }  # fmt: skip
