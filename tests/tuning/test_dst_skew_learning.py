"""DST learns a wrong attention / rest split from its own steps (issue 56): a closed loop with the
latency model as the clock (:mod:`tests.tuning.skew_loop`: 8 emulated ranks, top-k 512 tokens,
SAB + DST bidirectional, each micro-batch measured by a true model whose attention costs ``s`` x
the profile's, with 4 % timing noise, fed back through the trainer's feedback path).

From the third step on, DST's budgets never make the slowest rank slower than SAB's plan at the
base budget by the true model, and the calibration's split moves toward ``s``. With the split's
prior before this round (0.15) the filter was still 1.1-1.4x off a 4x split after 6 steps and
DST was up to 2.4 % slower than SAB alone there (the last test pins it)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tuning.skew_loop import MIXES, SKEWS, run_loop

SEEDS = range(4)
FIRST = 2  # from the third step on (index 2): two steps of evidence


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("skew", SKEWS)
def test_dst_is_not_slower_than_sab_once_the_split_is_learned(skew, mix):
    learned = []
    for seed in SEEDS:
        loop = run_loop(mix, skew, steps=6, seed=seed, noise=0.04)
        for i, step in enumerate(loop[FIRST:], start=FIRST + 1):
            slower = f"seed {seed} step {i}: DST {step.dst_s:.4f} s > SAB {step.sab_s:.4f} s"
            assert step.dst_s <= step.sab_s * (1 + 1e-9), slower
        # the part of the way (in logs) from the profile's split (1) to the truth (s)
        learned.append(np.log(loop[-1].ratio) / np.log(skew))
    assert min(learned) > 0.15 and max(learned) < 1.25, f"split learned {np.round(learned, 2)} of the way to {skew}"
    assert np.mean(learned) > 0.4, f"split learned {np.round(learned, 2)} of the way to {skew}"


@pytest.mark.parametrize("mix", MIXES)
def test_a_right_profile_keeps_dsts_gain(mix):
    """With the profile right (s = 1), DST lowers the true slowest rank on every step and seed,
    and timing noise moves the split by less than 1.4x either way (well inside the raises' 2x
    guard; the price of a prior that can learn a 4x split: 0.74-1.34 here, against 0.93-1.02
    with the old prior)."""
    gains = []
    for seed in SEEDS:
        loop = run_loop(mix, 1.0, steps=6, seed=seed, noise=0.04)
        gains += [s.gain for s in loop]
        assert all(1 / 1.4 < s.ratio < 1.4 for s in loop), f"seed {seed}: split {[round(s.ratio, 2) for s in loop]}"
    assert min(gains) > 1.0 and np.mean(gains) > 1.005


def test_the_old_split_prior_lets_dst_lose_to_sab():
    """The filter before this round (split prior 0.15, level prior 0.5), attention 4x dearer
    than profiled, heavy mix: a step from the third on where DST is over 2 % slower than SAB
    (what the wider prior removes, above)."""
    loop = run_loop("heavy", 4.0, steps=6, seed=2, noise=0.04, split_std=0.15)
    assert min(s.gain for s in loop[FIRST:]) < 0.98
    assert loop[-1].ratio < 1.5  # the split barely moved toward 4
