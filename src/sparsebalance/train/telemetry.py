"""Telemetry: one JSON line per step and rank (``metrics.jsonl``), a progress bar on rank 0, and
TensorBoard scalars when ``tensorboard`` is installed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from .records import StepResult


class Telemetry:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, is_main: bool, label: str):
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self._bar = None
        self._tb = None
        self._t0 = time.perf_counter()
        if not is_main:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc=label,
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
        )
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        except ImportError:  # tensorboard is optional
            self._tb = None

    def log(self, step: int, result: StepResult) -> None:
        """Append every rank's record; update the bar with the step summary (rank 0 only)."""
        if not self.is_main:
            return
        summary = result.summary.to_json()
        with self.path.open("a") as f:
            for rec in result.records:
                f.write(json.dumps({"step": step, **rec.to_json()}) + "\n")
            f.write(json.dumps({"step": step, "rank": "all", **summary}) + "\n")
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{summary['loss']:.3f}",
                tok_s=f"{summary['tokens_per_s']:.0f}",
                imbalance=f"{summary['imbalance']:.2f}",
            )
            self._bar.update(1)
        if self._tb is not None:
            for key in ("loss", "step_seconds", "tokens_per_s", "efficiency", "mean_density"):
                self._tb.add_scalar(key, summary[key], step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
