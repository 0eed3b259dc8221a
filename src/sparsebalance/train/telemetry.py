"""Telemetry: one JSON line per step and rank (``metrics.jsonl``), a progress bar on rank 0, and
TensorBoard scalars when ``tensorboard`` is installed.

``metrics.jsonl`` always matches the checkpoint a run continues from: on (re)start every record
after the starting step, and a torn last line (a kill mid-write), are cut off, so a resumed run
never logs a step twice."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..engine.summary import StepResult


class Telemetry:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, is_main: bool, label: str, bar: bool = True):
        """``bar``: the run's own progress bar (off when a caller shows one for several runs)."""
        self.is_main = is_main
        self._said_pipeline = False  # the line about a pipeline short of micro-batches: once a run
        self.path = Path(run_dir) / "metrics.jsonl"
        self._bar = None
        self._tb = None
        self._t0 = time.perf_counter()
        if not is_main:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        dropped, torn = truncate_metrics(self.path, start_step)
        if dropped or torn:
            print(
                f"sparsebalance train: metrics.jsonl cut back to step {start_step} "
                f"({dropped} records after it dropped{', and a torn last line' if torn else ''})",
                file=sys.stderr,
                flush=True,
            )
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc=label,
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
            disable=not bar,
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
        summary = result.report.to_log()
        if not self._said_pipeline:
            self._said_pipeline = pipeline_note(step, result.records)
        lines = [json.dumps({"step": step, **rec.to_json()}) for rec in result.records]
        lines.append(json.dumps({"step": step, "rank": "all", **summary}))
        with self.path.open("a") as f:  # one write per step: a kill tears at most the last line
            f.write("\n".join(lines) + "\n")
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{summary['loss']:.3f}",
                tok_s=f"{summary['tokens_per_s']:.0f}",
                balance=f"{summary['efficiency']:.2f}",  # the report's "balance eff.": one name for one thing
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


def pipeline_note(step: int, records) -> bool:
    """Say in one line (stderr) when a pipeline ran fewer micro-batches than it has stages (a
    stage then idles while the others work: 1F1B overlaps its stages only with at least that
    many); whether it was said."""
    for rec in records:
        stages, count = len(rec.stages), len(rec.units)
        if stages > 1 and 0 < count < stages:
            idle = sum(s["idle_s"] for s in rec.stages) / max(sum(s["idle_s"] + s["busy_s"] for s in rec.stages), 1e-12)
            print(
                f"sparsebalance train: note: at step {step} pipeline {rec.rank} ran {count} micro-batch"
                f"{'es' if count > 1 else ''} on {stages} stages, so its stages idled {100 * idle:.0f} % of the "
                f"step (1F1B overlaps them with >= {stages} micro-batches): lower --capacity or raise "
                "--global-batch (said once)",
                file=sys.stderr,
                flush=True,
            )
            return True
    return False


def truncate_metrics(path: Path, step: int) -> tuple[int, bool]:
    """Keep the records of steps ``<= step`` in ``path`` (rewritten atomically); returns (records
    dropped, whether a torn last line was dropped). A bad line elsewhere is an error."""
    if not path.is_file():
        return 0, False
    text = path.read_text()
    lines = text.split("\n")
    torn = bool(lines[-1])  # a complete file ends with "\n": the last piece is empty
    keep, dropped = [], 0
    for i, line in enumerate(lines[:-1], 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{i}: not a JSON record; fix or remove the file") from None
        if rec.get("step", 0) <= step:
            keep.append(line)
        else:
            dropped += 1
    if dropped or torn:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return dropped, torn
