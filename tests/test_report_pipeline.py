"""A pipeline run's report says each stage's busy time and bubble (issue 44)."""

from __future__ import annotations

import pytest

from sparsebalance.report_pipeline import pipeline_line, stage_means


def _rank(step: int, busy: tuple[float, float], idle: tuple[float, float]) -> dict:
    stages = [{"stage": s, "busy_s": b, "idle_s": i} for s, (b, i) in enumerate(zip(busy, idle, strict=True))]
    return {"step": step, "rank": 0, "stages": stages}


def test_the_stage_means_leave_the_warm_up_step_out():
    ranks = [_rank(1, (9.0, 9.0), (9.0, 9.0)), _rank(2, (1.0, 3.0), (2.0, 0.0)), _rank(3, (1.0, 3.0), (2.0, 0.0))]
    busy, idle = stage_means(ranks)
    assert busy.tolist() == [1.0, 3.0] and idle.tolist() == [2.0, 0.0]
    assert pipeline_line(ranks) == (
        "2 stages per pipeline (1F1B), mean per step: stage 0 busy 1.000 s, bubble 2.000 s (67 %), "
        "stage 1 busy 3.000 s, bubble 0.000 s (0 %)."
    )


def test_an_interleaved_pipeline_is_named_so():
    ranks = [_rank(1, (1.0, 1.0), (0.5, 0.5))]
    for stage in ranks[0]["stages"]:
        stage["chunks"] = 2
    assert pipeline_line(ranks).startswith("2 stages per pipeline (interleaved 1F1B, 2 chunks a stage), mean")
    del ranks[0]["stages"][0]["chunks"], ranks[0]["stages"][1]["chunks"]  # records written before the field
    assert pipeline_line(ranks).startswith("2 stages per pipeline (1F1B), mean")


@pytest.mark.parametrize("ranks", [[], [{"step": 1, "rank": 0, "stages": []}], [{"step": 1, "rank": 0}]])
def test_a_run_without_a_pipeline_has_no_pipeline_line(ranks):
    assert pipeline_line(ranks) == "" and stage_means(ranks) is None
