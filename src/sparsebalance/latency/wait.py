"""How long measuring a profile takes, said before the wait, and a bar through it.

The time is estimated from this machine and this profile, not fixed: the pilot's rough cost per
attention pair, token and call (:func:`~.measure._pilot_cost`) prices the chosen design's
micro-batches, which grow with the longest micro-batch profiled (at ``--capacity 16384`` the long
dense corner alone costs seconds per timing on a CPU). Measuring then times every micro-batch once
to warm up and at least ``rounds`` times, and goes on for at least the timing budget
(:func:`~.sweep.time_interleaved`, :mod:`.measure`): so about ``max(spent + (rounds + 1) x design,
budget)``, plus the optimizer's timing. The pilot is three small micro-batches timed once (noisy
on a busy machine), so the bar's total is estimated again from the warm-up's own time.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

OPTIMIZER_ALLOWANCE_S = 2.0
"""The AdamW step's timing and the fit after the micro-batches (a few seconds at most)."""


def expected_seconds(spent: float, design_seconds: float, budget_s: float, passes: int) -> float:
    """Seconds measuring takes in all: ``spent`` so far, ``passes`` more passes over the design's
    micro-batches (``design_seconds`` each: the pilot's estimate before the warm-up, the warm-up's
    own time after it), and at least ``budget_s`` in all."""
    return max(spent + passes * design_seconds, budget_s) + OPTIMIZER_ALLOWANCE_S


class SecondsBar:
    """A bar of seconds (``latency profile: 40%|####  | 28/70 s``) on stderr, from ``start`` (a
    ``perf_counter`` stamp) to the expected total; moved by :meth:`tick` after each timed call.
    Shown on a terminal only (``enabled`` and stderr a TTY)."""

    def __init__(self, total_s: float, start: float, enabled: bool = True) -> None:
        self.start = start
        self.bar = tqdm(
            total=round(total_s),
            desc="latency profile",
            file=sys.stderr,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total} s (estimated)",
            disable=None if enabled else True,  # None: off when stderr is not a terminal
            leave=False,
        )
        self.tick()

    def retotal(self, total_s: float) -> None:
        """A better estimate (the warm-up's own time)."""
        self.bar.total = round(total_s)
        self.bar.refresh()

    def tick(self) -> None:
        now = time.perf_counter() - self.start
        self.bar.update(max(0.0, min(now, self.bar.total) - self.bar.n))

    def close(self) -> None:
        self.bar.close()
