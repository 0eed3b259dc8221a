"""The trainer on a weighted mixture: per-component counts in the metrics, exact resume, and the
refusal to resume on other data (single process, CPU)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import sparsebalance.data.dataset as dataset
from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import Trainer
from tests.train.harness import MEMORISABLE, base_config

pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


@pytest.fixture
def mixture(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset, "CACHE_DIR", tmp_path / "cache")  # raw inputs prepared here
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": t * 6}) + "\n" for t in MEMORISABLE[:12]))
    b.write_text("".join(json.dumps({"text": t * 5}) + "\n" for t in MEMORISABLE[4:16][::-1]))
    return f"{a}:0.7,{b}:0.3"


def _run(cfg):
    torch.set_num_threads(1)
    return Trainer(cfg, Runtime(0, 1, torch.device("cpu"))).run()


def test_mixture_resume_is_exact_and_other_data_is_refused(tmp_path, mixture):
    cfg = base_config(tmp_path, data=mixture, steps=4, global_batch=4, capacity=256)
    full = _run(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    counts = [x["data_documents"] for x in lines if x["rank"] == "all"]
    assert len(counts) == 4 and all(sum(c.values()) == 4 for c in counts)
    assert set(counts[0]) == {p.rpartition(":")[0] for p in mixture.split(",")}
    described = json.loads((tmp_path / "run" / "data.json").read_text())
    assert [c["documents"] for c in described["components"]] == [12, 12]

    first = replace(cfg, steps=2, out=str(tmp_path / "part"))
    _run(first)
    resumed = _run(replace(first, steps=4, resume=True))
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-6, abs=1e-6)

    def refused(bad_cfg, message):
        with pytest.raises(ValueError, match="trained on other data") as err:
            Trainer(replace(bad_cfg, steps=4, resume=True), Runtime(0, 1, torch.device("cpu")))
        assert message in str(err.value)

    refused(replace(first, data=mixture.replace(":0.7", ":0.6").replace(":0.3", ":0.4")), "mixture weight 0.7 -> 0.6")
    refused(replace(first, min_len=2), "--min-len: checkpoint None, now 2")
    a = tmp_path / "a.jsonl"
    a.write_text(a.read_text().replace("4821", "4822"))
    refused(first, "content changed")
