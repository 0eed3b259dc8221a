"""Long documents are trained whole by default: ``--strategy auto`` is ``sab-cp`` with two or more
real ranks and ``sab`` where CP units cannot run (one rank, ``--emulate-ranks``), where the run's
first lines say what ``--overlong`` does to documents over the capacity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparsebalance.cli import main
from sparsebalance.train import TrainConfig
from sparsebalance.train.config import resolve_strategy
from sparsebalance.train.launch import overlong_note, preflight


def test_auto_is_sab_cp_on_real_ranks_and_sab_elsewhere(tmp_path):
    cfg = TrainConfig(out=str(tmp_path / "run"))
    assert cfg.strategy == "auto"
    assert resolve_strategy(cfg, 2).strategy == "sab-cp"
    assert resolve_strategy(cfg, 8).strategy == "sab-cp"
    assert resolve_strategy(cfg, 1).strategy == "sab"
    emulated = TrainConfig(out=str(tmp_path / "run"), emulate_ranks=4)
    assert resolve_strategy(emulated, 4).strategy == "sab"
    # an explicit strategy is kept; --cp K with auto means sab-cp
    explicit = TrainConfig(out=str(tmp_path / "run"), strategy="sab", overlong="split")
    assert resolve_strategy(explicit, 4).strategy == "sab"
    assert resolve_strategy(TrainConfig(out=str(tmp_path / "run"), cp=2), 4).strategy == "sab-cp"
    with pytest.raises(ValueError, match=r"TrainConfig.strategy \(--strategy\) must be auto or one of"):
        TrainConfig(out=str(tmp_path / "run"), strategy="whole")


def test_the_command_line_launches_the_resolved_strategy(tmp_path, monkeypatch):
    launched = []

    def fake_launch(cfg, nproc, rdzv=None, together=()):
        launched.append((cfg.strategy, nproc))
        return True  # launched (not a complete run's --resume)

    monkeypatch.setattr("sparsebalance.commands.train.launch", fake_launch)
    monkeypatch.setattr("sparsebalance.commands.train.write_report", lambda out: (None, {}))
    common = ["--json", "--out", str(tmp_path / "run")]
    for extra in (
        ["--nproc", "2"],
        ["--nproc", "4"],
        ["--nproc", "1"],
        ["--emulate-ranks", "4"],
        ["--nproc", "2", "--strategy", "sab"],
    ):
        assert main(["train", *extra, *common]) == 0
    assert launched == [("sab-cp", 2), ("sab-cp", 4), ("sab", 1), ("sab", 1), ("sab", 2)]


LENGTHS = np.array([100, 513, 1159, 400, 1024, 2049])  # three over 512, one over 4 x 512


def test_the_note_says_what_happens_to_over_long_documents(tmp_path):
    out = str(tmp_path / "run")
    one = resolve_strategy(TrainConfig(out=out, capacity=512), 1)
    line = overlong_note(one, LENGTHS, 1)
    assert line == (
        "4 of 6 documents are longer than --capacity 512: --overlong split: cut "
        "into 512-token chunks trained as separate documents (CP units need >= 2 ranks)"
    )
    emulated = TrainConfig(out=out, capacity=512, emulate_ranks=4, overlong="truncate")
    line = overlong_note(resolve_strategy(emulated, 4), LENGTHS, 4)
    assert "truncated to their first 512 tokens" in line and "--emulate-ranks" in line
    explicit = TrainConfig(out=out, capacity=512, strategy="sab")
    assert "--strategy sab-cp would train them whole" in overlong_note(explicit, LENGTHS, 4)
    # sab-cp: only what no unit of all ranks holds follows --overlong
    whole = resolve_strategy(TrainConfig(out=out, capacity=512), 4)
    assert overlong_note(whole, LENGTHS, 4).startswith(
        "1 of 6 documents are longer than 4 ranks x --capacity 512 = 2048 tokens"
    )
    assert overlong_note(whole, LENGTHS[:5], 4) is None  # nothing over: no line
    per_count = TrainConfig(out=out, capacity=None, micro_batches=2)
    assert overlong_note(per_count, LENGTHS, 1) is None  # no token bound


def test_preflight_prints_the_note_first(tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    words = " ".join(f"w{i}" for i in range(600))
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in [words, "short one"] * 4))
    cfg = resolve_strategy(TrainConfig(data=str(data), out=str(tmp_path / "run"), capacity=256, global_batch=2), 1)
    preflight(cfg, 1)
    err = capsys.readouterr().err
    assert "4 of 8 documents are longer than --capacity 256: --overlong split" in err
