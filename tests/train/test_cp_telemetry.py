"""A demo-sized hybrid run on 4 gloo processes: a document 3x the capacity trains whole on a CP
unit of 3 (or 4) ranks (no ``--overlong`` split counted), the records say which unit each rank
ran and its wait in the ring, the measured unit recalibrates the ring terms (saved with the
checkpoint), and the report names the document and draws the unit across its ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparsebalance.data import load_corpus, load_tokenizer
from sparsebalance.report import write_report
from tests.train.harness import MEMORISABLE, base_config, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


def _long_doc_dataset(tmp):
    """11 short documents and one long one; returns (path, the long one's tokens)."""
    path = tmp / "mix.jsonl"
    texts = [t * 2 for t in MEMORISABLE[:11]] + [" ".join(MEMORISABLE[:4]) * 12]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    corpus = load_corpus(str(path), load_tokenizer(None), "text", 256, 0, None, None)
    return path, int(corpus.lengths().max())


def test_a_document_3x_the_capacity_trains_whole_on_4_ranks(tmp_path):
    data, longest = _long_doc_dataset(tmp_path)
    capacity = -(-longest // 3)  # the long document is 3x the capacity: a unit of 3 ranks
    cfg = base_config(
        tmp_path, data=str(data), strategy="sab-cp", capacity=capacity, steps=2, global_batch=12, deterministic=False
    )
    res = run_ranks(cfg, 4, tmp_path)
    assert all(math.isfinite(x) for x in res[0]["losses"]) and res[0]["losses"] == res[3]["losses"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x["rank"] == "all"]
    per_rank = [x for x in lines if x["rank"] != "all"]
    for s in steps:  # trained whole every step: no chunk, one CP unit of >= 3 ranks
        assert s["num_split_chunks"] == 0
        (doc,) = [d for d in s["cp_documents"] if d["tokens"] == longest]
        assert doc["degree"] >= 3 and doc["offset"] == 0 and len(doc["ranks"]) == doc["degree"]
    # each rank says which unit it ran: the unit's ranks name it, with its wait inside the ring
    first = [x for x in per_rank if x["step"] == 1]
    doc = next(d for d in steps[0]["cp_documents"] if d["tokens"] == longest)
    for rec in first:
        cp = [u for u in rec["units"] if u["degree"] > 1]
        if rec["rank"] in doc["ranks"]:
            (u,) = cp
            assert u["ranks"] == doc["ranks"] and u["sample_ids"] == [doc["id"]]
            assert u["ring"] == "flat" and u["slot"] >= 0 and 0 <= u["ring_wait_s"] <= u["seconds"]
            assert u["start_s"] is not None and u["start_s"] >= 0
        else:
            assert cp == [] and all(u["ranks"] == [] for u in rec["units"])
        assert rec["ring_wait_s"] == pytest.approx(sum(u["ring_wait_s"] for u in rec["units"]))
    # the measured CP units recalibrated the ring terms; the state travels with the checkpoint
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-000002" / "state.pt", weights_only=True)["trainer"]
    assert state["context"]["counts"]["comm"] == 2  # one CP unit per step
    report, _ = write_report(tmp_path / "run")
    text = report.read_text()
    assert f"document {doc['id']}, {longest:,} tokens, on " in text and "at steps 1, 2" in text
    assert "no split counted" in text and (tmp_path / "run" / "units.png").is_file()
