"""The run report on over-long documents: which were trained whole over how many ranks, how many
``--overlong split`` chunks were cut, and the units plot (a fabricated metrics.jsonl)."""

from __future__ import annotations

import json

import pytest

from sparsebalance.report import long_documents, write_report


def _step(step, cp_docs, chunks, overlong):
    return {
        "step": step,
        "rank": "all",
        "loss": 5.0,
        "step_seconds": 1.0,
        "max_compute_s": 0.9,
        "mean_compute_s": 0.8,
        "efficiency": 0.9,
        "bubble_fraction": 0.1,
        "mean_density": 0.9,
        "tokens_per_s": 100.0,
        "num_overlong": overlong,
        "num_split_chunks": chunks,
        "cp_documents": cp_docs,
    }


def _ranks(step):
    cp = {
        "slot": 0,
        "ranks": [1, 2, 3],
        "degree": 3,
        "ring": "flat",
        "sample_ids": [17],
        "tokens": 4096,
        "start_s": None,
        "seconds": 2.0,
        "ring_wait_s": 0.1,
    }
    one = {
        "slot": 1,
        "ranks": [],
        "degree": 1,
        "ring": "none",
        "sample_ids": [3],
        "tokens": 900,
        "start_s": None,
        "seconds": 1.5,
        "ring_wait_s": 0.0,
    }
    return [
        {
            "step": step,
            "rank": 0,
            "compute_s": 1.5,
            "derived_bubble_s": 0.5,
            "gamma_mean": 0.9,
            "density": 0.9,
            "units": [one],
        },
        *(
            {
                "step": step,
                "rank": r,
                "compute_s": 2.0,
                "derived_bubble_s": 0.0,
                "gamma_mean": 0.9,
                "density": 0.9,
                "units": [cp],
            }
            for r in (1, 2, 3)
        ),
    ]


DOC = {"id": 17, "offset": 0, "tokens": 12288, "degree": 3, "ranks": [1, 2, 3], "ring": "flat"}


def test_long_documents_line_names_documents_degrees_and_split_count():
    whole = long_documents([_step(1, [DOC], 0, 0), _step(2, [], 0, 0), _step(3, [DOC], 0, 0)])
    assert whole == (
        "trained whole over context-parallel ranks: document 17, 12,288 tokens, on "
        "3 ranks (flat ring) at steps 1, 3. no split counted (--overlong cut no "
        "document)."
    )
    cut = long_documents([_step(1, [], 3, 1), _step(2, [], 6, 2)])
    assert cut == ("no document ran over several ranks. --overlong split cut 3 documents into 9 chunks.")
    assert long_documents([{"step": 1, "loss": 1.0}]) == ""  # runs before the fields


def test_report_writes_the_line_and_the_units_plot(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "sparsebalance"
    run.mkdir()
    lines = [*_ranks(1), _step(1, [DOC], 0, 0), *_ranks(2), _step(2, [DOC], 0, 0)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    path, _ = write_report(tmp_path)
    text = path.read_text()
    want = "Long documents, sparsebalance: trained whole over context-parallel ranks: document 17"
    assert want in text
    assert "![units.png](units.png)" in text and (tmp_path / "units.png").stat().st_size > 0
