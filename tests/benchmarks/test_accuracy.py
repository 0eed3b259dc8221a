"""benchmarks/accuracy.py: the paired statistics, and the whole pipeline in --quick mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import accuracy_report


@pytest.mark.parametrize("t, df", [(12.706, 1), (4.303, 2), (3.182, 3), (2.776, 4), (2.228, 10)])
def test_t_p_value_matches_the_5_percent_table(t, df):
    assert accuracy_report.t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-3)
    assert accuracy_report.t_two_sided_p(0.0, df) == pytest.approx(1.0)


def test_paired_counts_wins_and_is_signed():
    c = accuracy_report.paired([0.5, 0.7, 0.6], [0.4, 0.4, 0.6])
    assert (c["wins"], c["losses"], c["ties"]) == (2, 0, 1)
    assert c["mean"] == pytest.approx(0.4 / 3)
    assert 0 < c["p"] < 1


@pytest.mark.slow
def test_quick_run_writes_every_variant_and_metric(tmp_path):
    import accuracy

    assert accuracy.main(["--quick", "--out", str(tmp_path)]) == 0
    md = next(tmp_path.glob("*-accuracy-quick-cpu.md")).read_text()
    data = json.loads(next(tmp_path.glob("*-accuracy-quick-cpu.json")).read_text())
    names = data["args"]["variants"]
    assert len(names) == 7 and all(f"| {v} |" in md for v in names)
    assert "Paired by seed" in md and "recall per layer" in md
    for rec in data["records"]:
        assert 0 < rec["train_density"] <= 1 and rec["predicted_step_s"] > 0
        for ev in rec["eval"].values():
            assert set(ev["recall"]) == {"0", "1"}  # the recipe's two layers
            assert all(0 < r <= 1 + 1e-9 for r in ev["recall"].values())
            assert ev["ppl"] > 1 and set(ev["mqar"]["by_depth"]) == {
                "0.0",
                "0.25",
                "0.5",
                "0.75",
                "1.0",
            }
    dense = next(r for r in data["records"] if r["variant"] == "dense")
    assert dense["train_density"] == pytest.approx(1.0)
    assert all(v == pytest.approx(1.0) for v in dense["eval"]["dense"]["recall"].values())
