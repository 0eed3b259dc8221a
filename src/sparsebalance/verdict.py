"""The demo's verdict: SparseBalance's speed-up over the baseline, how sure it is, and on what.

The two runs are stepped in turn on the same samples (:mod:`sparsebalance.train.interleave`), so
step ``i`` of each shares the machine's state of that moment. The speed-up is the report's (the
baseline's mean step time over SparseBalance's, steps 2..N); its 95 % interval comes from
resampling the step pairs with replacement (a paired bootstrap: a slow phase of the machine moves
both steps of a pair). The verdict is *inconclusive* when the interval includes 1.0 (the run
cannot tell which is faster) or when the machine was busier than its cores at the start or the
end (other work took turns with the ranks: what was timed is partly the others; at the end the
load includes the demo's own ranks, so half a core more is allowed there). Then it says how to run
it again.

``machine.json`` (written by ``train --demo`` beside its runs): the cores, the device, the ranks
and the 1-minute load average at the start and the end.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MACHINE = "machine.json"
LEVEL = 0.95
RESAMPLES = 4000
END_MARGIN = 0.5
"""At the end the 1-minute load counts the demo's own ranks (one per core on a CPU) and its
launcher: busy when it exceeds the cores by more than this."""
RERUN = "sparsebalance train --demo --steps 40"
"""How to run the demo again for a firmer answer: more step pairs (on a quieter machine)."""


def machine_start(device: str, ranks: int, rerun: str = RERUN) -> dict:
    """What the machine is and how busy, as a run starts; ``rerun``: the command an
    inconclusive verdict suggests (the demo's own flags, e.g. ``--pp 2``, with more steps)."""
    start = {"cores": os.cpu_count() or 1, "device": device, "ranks": ranks, "load_start": _load()}
    return {**start, "start": time.time(), "rerun": rerun}


def rerun_command(pp: int = 1, pp_virtual: int = 1, pp_schedule: str = "1f1b") -> str:
    """The demo with more steps and the pipeline flags it ran with."""
    flags = (f" --pp {pp}" if pp > 1 else "") + (f" --pp-virtual {pp_virtual}" if pp_virtual > 1 else "")
    flags += f" --pp-schedule {pp_schedule}" if pp_schedule != "1f1b" else ""
    return RERUN + flags


def machine_end(machine: dict) -> dict:
    """``machine`` with the load at the end and the seconds in between."""
    return {**machine, "load_end": _load(), "seconds": time.time() - machine["start"]}


def write_machine(folder: Path, machine: dict) -> Path:
    path = Path(folder) / MACHINE
    path.write_text(json.dumps(machine, indent=1) + "\n")
    return path


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not on every platform
        return None


def paired_interval(
    base: np.ndarray, other: np.ndarray, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float, float]:
    """``mean(base) / mean(other)`` and its ``level`` interval from resampling the pairs
    ``(base[i], other[i])`` with replacement (percentiles of the resampled ratios; seeded)."""
    base, other = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if base.shape != other.shape or base.size < 2:
        raise ValueError(f"need two or more step pairs, got {base.size} and {other.size} steps")
    ratio = float(base.mean() / other.mean())
    idx = np.random.default_rng(seed).integers(0, base.size, (resamples, base.size))
    ratios = base[idx].mean(axis=1) / other[idx].mean(axis=1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return ratio, float(low), float(high)


@dataclass(frozen=True)
class Verdict:
    """SparseBalance's measured speed-up over the baseline, its interval, and on what machine."""

    speedup: float
    low: float
    high: float
    pairs: int
    machine: dict
    reasons: tuple[str, ...]
    """Why the run cannot decide (empty: it can)."""

    @property
    def conclusive(self) -> bool:
        return not self.reasons

    def lines(self) -> list[str]:
        """Two lines: the verdict and the machine."""
        m = self.machine
        interval = f"95 % interval {self.low:.2f}-{self.high:.2f}, {self.pairs} step pairs"
        said = f"SparseBalance {self.speedup:.2f}x the baseline's speed ({interval}, taken in turn on the same samples)"
        if self.conclusive:
            head = f"Verdict: {said}."
        else:
            head = (
                f"Verdict: inconclusive: {said}, but {' and '.join(self.reasons)}. Run it again on a quieter machine "
                f"(load below {m['cores']}) or with more steps: {m.get('rerun', RERUN)}."
            )
        loads = ", ".join(f"{_shown(m.get(k))} at the {k.split('_')[1]}" for k in ("load_start", "load_end"))
        return [head, f"Machine: {m['cores']} cores, {m['device']}, {m['ranks']} ranks; load (1 min) {loads}."]


def verdict(base_steps: list[dict], sb_steps: list[dict], machine: dict) -> Verdict:
    """The verdict on two runs' per-step summaries (``metrics.jsonl``'s ``"rank": "all"``
    records), paired by step; step 1 (warm-up) left out, as in the report's means."""
    base = {s["step"]: s["step_seconds"] for s in base_steps}
    sb = {s["step"]: s["step_seconds"] for s in sb_steps}
    steps = sorted(set(base) & set(sb))[1:]
    reasons = []
    if len(steps) < 2:
        reasons.append(f"{len(steps)} step pairs after the warm-up are too few to resample")
        pair = [base[s] for s in steps] or [np.nan], [sb[s] for s in steps] or [np.nan]
        speedup = float(np.mean(pair[0]) / np.mean(pair[1]))
        return Verdict(speedup, speedup, speedup, len(steps), machine, tuple(reasons))
    speedup, low, high = paired_interval(np.array([base[s] for s in steps]), np.array([sb[s] for s in steps]))
    if low <= 1.0 <= high:
        reasons.append("the interval includes 1.0 (either could be faster)")
    busy = max(_busy(machine, "load_start", 0.0), _busy(machine, "load_end", END_MARGIN))
    if busy:
        reasons.append(f"the machine was busy (load {busy:.1f} on {machine['cores']} cores)")
    return Verdict(speedup, low, high, len(steps), machine, tuple(reasons))


def _busy(machine: dict, key: str, margin: float) -> float:
    """The load ``key`` if it exceeds the cores by more than ``margin``, else 0."""
    load = machine.get(key)
    return load if load is not None and load > machine["cores"] + margin else 0.0


def _shown(load: float | None) -> str:
    return "unknown" if load is None else f"{load:.1f}"


def verdict_lines(root: Path, data: dict) -> list[str]:
    """The demo's verdict and machine, for its report, when ``root`` holds its ``machine.json``
    and both runs (``data``: run name -> (per-rank records, per-step summaries)); else none."""
    path = Path(root) / MACHINE
    if not path.is_file() or not {"baseline", "sparsebalance"} <= set(data):
        return []
    machine = json.loads(path.read_text())
    return verdict(data["baseline"][1], data["sparsebalance"][1], machine).lines()
