"""Issue 55, item 1: the demo's verdict says how sure it is. The speed-up comes with a 95 %
interval from resampling the step pairs, the machine (cores, device) and its load at the start
and the end; it is "inconclusive", with how to run it again, when the interval includes 1.0 or
the machine was busier than its cores. The same in report.md."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparsebalance.report import write_report
from sparsebalance.verdict import MACHINE, RERUN, paired_interval, verdict
from tests.test_report_files import _metrics

QUIET = {"cores": 2, "device": "cpu", "ranks": 2, "load_start": 0.3, "load_end": 2.1}


def _steps(seconds) -> list[dict]:
    return [{"step": i + 1, "step_seconds": float(s)} for i, s in enumerate(seconds)]


def test_the_interval_is_the_paired_ratio_resampled():
    rng = np.random.default_rng(0)
    load = rng.uniform(1.0, 3.0, 40)  # the machine's state moves both steps of a pair alike
    base, ours = 1.2 * load, load * rng.normal(1.0, 0.02, 40)
    ratio, low, high = paired_interval(base, ours)
    assert ratio == pytest.approx(base.mean() / ours.mean())
    assert 1.15 < low < ratio < high < 1.25  # tight: pairing cancels the load
    assert paired_interval(base, ours) == (ratio, low, high)  # seeded
    with pytest.raises(ValueError, match="two or more step pairs"):
        paired_interval([1.0], [1.0])


def test_a_clear_gain_on_a_quiet_machine_is_conclusive():
    rng = np.random.default_rng(1)
    base = rng.normal(2.4, 0.05, 20)
    v = verdict(_steps(base), _steps(base / 1.12), QUIET)
    assert v.conclusive and v.pairs == 19 and 1.1 < v.low < v.high < 1.14
    head, machine = v.lines()
    assert head.startswith("Verdict: SparseBalance 1.12x the baseline's speed (95 % interval 1.1")
    assert "19 step pairs, taken in turn on the same samples" in head and "inconclusive" not in head
    assert machine == "Machine: 2 cores, cpu, 2 ranks; load (1 min) 0.3 at the start, 2.1 at the end."


def test_an_interval_across_one_is_inconclusive_and_says_how_to_rerun():
    rng = np.random.default_rng(2)
    base = rng.normal(12.0, 2.0, 20)  # the busy machine: 0.89x, interval 0.78-1.01
    v = verdict(_steps(base), _steps(base * rng.normal(1.0, 0.25, 20)), QUIET)
    assert not v.conclusive and v.low < 1.0 < v.high
    head = v.lines()[0]
    assert head.startswith("Verdict: inconclusive: SparseBalance ")
    assert f"95 % interval {v.low:.2f}-{v.high:.2f}, 19 step pairs" in head and RERUN in head
    assert "but the interval includes 1.0 (either could be faster)" in head


def test_a_busy_machine_is_inconclusive_whatever_the_interval():
    base = np.linspace(2.0, 2.2, 20)
    busy = {**QUIET, "load_start": 7.0}
    v = verdict(_steps(base), _steps(base / 1.2), busy)
    assert v.low > 1.0 and not v.conclusive
    assert "the machine was busy (load 7.0 on 2 cores)" in v.lines()[0]
    # the end's load counts the demo's own ranks: up to half a core over is not "busy"
    assert verdict(_steps(base), _steps(base / 1.2), {**QUIET, "load_end": 2.4}).conclusive
    assert not verdict(_steps(base), _steps(base / 1.2), {**QUIET, "load_end": 2.6}).conclusive


def test_one_step_is_too_few_to_say():
    v = verdict(_steps([3.0, 2.0]), _steps([3.0, 1.0]), QUIET)
    assert not v.conclusive and "1 step pairs after the warm-up are too few" in v.lines()[0]


def test_the_report_of_a_demo_states_the_verdict(tmp_path):
    root = tmp_path / "demo"
    _metrics(root / "baseline", 2.0)
    _metrics(root / "sparsebalance", 1.0)
    (root / MACHINE).write_text(json.dumps(QUIET))
    text = write_report(root, plots=False)[0].read_text()
    verdict_line = next(x for x in text.splitlines() if x.startswith("Verdict: "))
    assert "SparseBalance 2.00x the baseline's speed (95 % interval 2.00-2.00, 2 step pairs" in verdict_line
    assert "Machine: 2 cores, cpu, 2 ranks; load (1 min) 0.3 at the start, 2.1 at the end." in text
    (root / MACHINE).unlink()  # not a demo (no machine record): no verdict
    assert "Verdict" not in write_report(root, plots=False)[0].read_text()


def test_a_pipeline_demo_suggests_rerunning_with_its_pipeline_flags():
    """After ``--demo --pp 2 --pp-virtual 2`` the inconclusive verdict's command keeps the
    pipeline (it suggested the plain demo before)."""
    from sparsebalance.verdict import machine_start, rerun_command

    assert rerun_command() == RERUN
    machine = {**QUIET, "rerun": machine_start("cpu", 2, rerun_command(2, 2))["rerun"]}
    base = np.linspace(2.0, 2.2, 20)
    head = verdict(_steps(base), _steps(base), machine).lines()[0]
    assert head.endswith(f"more steps: {RERUN} --pp 2 --pp-virtual 2.")
    assert (
        "more steps: sparsebalance train --demo --steps 40 --pp 2."
        in verdict(_steps(base), _steps(base), {**QUIET, "rerun": rerun_command(2)}).lines()[0]
    )
