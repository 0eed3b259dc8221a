"""Issue 55 (docs/pipeline.md's walk): a ``--pp`` run's summary said ``bubble frac. 0.000`` (the
data-parallel bubble of one pipeline) while its stages idled 42-59 %; now it shows the pipeline's
bubble, each stage's below. And a pipeline given fewer micro-batches than stages (``--capacity
16384``: one per step) is said in one line, once a run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sparsebalance.report import write_report
from sparsebalance.report_pipeline import pipeline_bubble
from sparsebalance.train.telemetry import pipeline_note
from tests.test_report_files import _metrics
from tests.test_report_pipeline import _rank


def test_a_pipeline_run_summarises_its_pipeline_bubble(tmp_path):
    run = _metrics(tmp_path / "pp")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for rec in lines:  # stage 0 busy 1 s idle 3 s, stage 1 busy 2 s idle 2 s: 5 of 8 s idle
        if rec["rank"] != "all":
            rec["stages"] = _rank(rec["step"], (1.0, 2.0), (3.0, 2.0))["stages"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ranks = [x for x in lines if x["rank"] != "all"]
    assert pipeline_bubble(ranks) == pytest.approx(5 / 8)
    text = write_report(run, plots=False)[0].read_text()
    row = next(x for x in text.splitlines() if x.startswith("| pp |"))
    assert row.split(" | ")[4] == "0.625"  # bubble frac.: the pipeline's, not the ranks' 0.25
    assert "With --pp the bubble is the pipeline's: its stages' idle share of the step" in text
    assert "bubble fraction = 1 - efficiency" not in text.replace("without --pp, bubble fraction", "")
    assert "stage 0 busy 1.000 s, bubble 3.000 s (75 %)" in text  # each stage's
    assert pipeline_bubble([x for x in ranks if False]) is None


def _record(rank: int, units: int, stages: int) -> SimpleNamespace:
    per_stage = [{"stage": s, "busy_s": 1.0, "idle_s": 1.0} for s in range(stages)]
    return SimpleNamespace(rank=rank, units=[{}] * units, stages=per_stage if stages > 1 else [])


def test_a_pipeline_short_of_micro_batches_is_said_once(capsys):
    assert not pipeline_note(1, [_record(0, 2, 2), _record(1, 3, 2)])  # enough: nothing said
    assert capsys.readouterr().err == ""
    assert not pipeline_note(1, [_record(0, 1, 1)])  # no pipeline
    assert pipeline_note(3, [_record(0, 2, 4), _record(1, 4, 4)])
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "sparsebalance train: note: at step 3 pipeline 0 ran 2 micro-batches on 4 stages, so its stages idled "
        "50 % of the step (1F1B overlaps them with >= 4 micro-batches): lower --capacity or raise --global-batch "
        "(said once)"
    )


def test_the_run_line_names_the_grid_and_its_chunks(tmp_path, capsys):
    from sparsebalance.commands.train import _say
    from tests.train.harness import base_config

    for over, grid in (({"pp": 2}, "(DP 1 x PP 2)"), ({"pp": 2, "pp_virtual": 2}, "(DP 1 x PP 2, 2 chunks a stage)")):
        cfg = base_config(tmp_path, **over)
        _say({str(cfg.out): "run"}, 2)(cfg)
        assert f"ranks=2 {grid}, steps=" in capsys.readouterr().out
