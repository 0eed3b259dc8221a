"""Faults and bad input, single process and fast: the run-folder lock, metrics cut back on resume,
checkpoint checksums and fallback, early validation, data readers, one-line errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from sparsebalance.cli import main
from sparsebalance.engine.runtime import Runtime
from sparsebalance.report import load_run
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.train.checkpoint import (
    find_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from sparsebalance.train.launch import default_nproc
from sparsebalance.train.runlock import LOCK_NAME, RunLock, RunLockError, join
from sparsebalance.train.telemetry import truncate_metrics
from tests.train.harness import base_config

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning"),
]


# ------------------------------------------------------------------ run-folder lock
def _write_lock(run, owners):
    run.mkdir(parents=True, exist_ok=True)
    (run / LOCK_NAME).write_text(json.dumps({"token": "t", "since": 0, "owners": owners}))


def test_a_second_run_refuses_while_the_first_is_live(tmp_path):
    with RunLock(tmp_path / "run") as first:
        assert first.note is None
        with pytest.raises(RunLockError, match=f"another run is live.*pid {os.getpid()}"):
            RunLock(tmp_path / "run").acquire()
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released
    RunLock(tmp_path / "run").acquire().release()


def test_a_stale_lock_is_taken_over_and_said(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that certainly ran and is gone
    _write_lock(tmp_path / "run", [{"host": socket.gethostname(), "pid": dead.pid, "start": None}])
    with RunLock(tmp_path / "run") as lock:
        assert lock.note is not None and f"pid {dead.pid}" in lock.note
        assert "not running" in lock.note
    # a corrupt lock file has nobody to wait for either
    (tmp_path / "run" / LOCK_NAME).write_text("{not json")
    with RunLock(tmp_path / "run") as lock:
        assert lock.note is not None


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    me = {"host": socket.gethostname(), "pid": os.getpid(), "start": "1"}  # our pid, other start
    _write_lock(tmp_path / "run", [me])
    with RunLock(tmp_path / "run") as lock:
        assert lock.note is not None


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    _write_lock(tmp_path / "run", [{"host": "node-17", "pid": 1, "start": None}])
    with pytest.raises(RunLockError, match=r"pid 1 on node-17.*if no run is live on node-17"):
        RunLock(tmp_path / "run").acquire()


def test_a_worker_joins_its_launchers_lock(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        assert not join(tmp_path / "run", "someone-else")
        assert join(tmp_path / "run", lock.token)
        held = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert len(held["owners"]) == 2


# ------------------------------------------------------------------ metrics.jsonl
def _metrics(path, steps, torn=False):
    lines = []
    for s in range(1, steps + 1):
        lines += [json.dumps({"step": s, "rank": 0}), json.dumps({"step": s, "rank": "all", "loss": float(s)})]
    path.write_text("\n".join(lines) + "\n" + ('{"step": 9, "ra' if torn else ""))


def test_resume_cuts_metrics_back_to_the_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _metrics(path, 5, torn=True)
    assert truncate_metrics(path, 3) == (4, True)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in recs if r["rank"] == "all"] == [1, 2, 3]
    assert truncate_metrics(path, 3) == (0, False)  # idempotent; file untouched
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        truncate_metrics(path, 5)


def test_report_tolerates_a_torn_last_line(tmp_path):
    _metrics(tmp_path / "metrics.jsonl", 2, torn=True)
    _, steps = load_run(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]


# ------------------------------------------------------------------ checkpoints
def _save(run, step):
    torch.manual_seed(step)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(run, step, model, opt, sched, {"step": step}, [], True)
    return model, opt, sched


def test_flipped_bytes_are_detected_and_the_previous_checkpoint_is_used(tmp_path):
    for step in (1, 2):
        model, opt, sched = _save(tmp_path, step)
    newest = tmp_path / "checkpoints" / "step-000002"
    assert find_checkpoint(tmp_path) == (newest, [])
    data = bytearray((newest / "model.pt").read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])  # 64 flipped bytes
    (newest / "model.pt").write_bytes(bytes(data))
    path, notes = find_checkpoint(tmp_path)
    assert path == tmp_path / "checkpoints" / "step-000001"
    assert len(notes) == 1 and "step-000002/model.pt: corrupt" in notes[0]
    assert "resuming from step-000001 instead" in notes[0]
    state = load_checkpoint(path, model, opt, sched)
    assert state["trainer"]["step"] == 1


@pytest.mark.parametrize("damage", ["empty", "truncated", "deleted"])
def test_damaged_state_file_is_named(tmp_path, damage):
    _save(tmp_path, 1)
    f = tmp_path / "checkpoints" / "step-000001" / "state.pt"
    if damage == "deleted":
        f.unlink()
    else:
        f.write_bytes(b"" if damage == "empty" else f.read_bytes()[:100])
    path, notes = find_checkpoint(tmp_path)
    assert path is None and len(notes) == 1 and "step-000001/state.pt" in notes[0]


def test_latest_pointing_to_a_missing_step_falls_back(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / "checkpoints" / "latest").write_text("step-000007\n")
    path, notes = find_checkpoint(tmp_path)
    assert path == latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-000001"
    assert notes == ["checkpoints/latest names step-000007, which is missing; resuming from step-000001 instead"]


# ------------------------------------------------------------------ early validation
def test_cheap_checks_fail_at_construction(tmp_path):
    (tmp_path / "file").write_text("x")
    cases = [
        (dict(out=str(tmp_path / "file")), r"out='.*' \(--out\): exists and is not a folder"),
        (dict(out=str(tmp_path / "file" / "run")), r"out='.*' \(--out\): .*is not a folder"),
        (dict(out=str(tmp_path / "none"), resume=True), r"resume \(--resume\): no checkpoint"),
        (dict(out=str(tmp_path / "r"), resume=True, overwrite=True), "pick one"),
        (dict(capacity=0), r"capacity \(--capacity\) must be >= 1"),
        (dict(checkpoint_every=-1), r"checkpoint_every \(--checkpoint-every\) must be >= 0"),
        (dict(lr=float("nan")), r"lr \(--lr\) must be a finite number"),
        (dict(profile=str(tmp_path / "p.json")), r"profile='.*' \(--profile\): no such file"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            TrainConfig(**kwargs)


def test_nproc_zero_is_refused():
    with pytest.raises(ValueError, match="--nproc must be >= 1, got 0"):
        default_nproc(TrainConfig(), 0)
    with pytest.raises(ValueError, match="--emulate-ranks runs in one process"):
        default_nproc(TrainConfig(emulate_ranks=4), 2)
    assert default_nproc(TrainConfig(emulate_ranks=4), None) == 1


BAD_DATA = [
    ("a.jsonl", '{"text": "fine"}\n"just a string"\n', "a.jsonl:2: not a JSON object"),
    ("b.jsonl", "12\n", "b.jsonl:1: not a JSON object"),
    ("c.jsonl", '{"text": {"a": 1}}\n', "c.jsonl:1: text is not a string"),
    ("d.jsonl", '{"text": ["x"]}\n', "d.jsonl:1: text is not a string"),
    ("e.json", '[{"text": "x"}, {"text": 5}]', "e.json"),
    ("f.json", "{broken", "f.json"),
    ("g.csv", "text,label\nhello,1\n", "g.csv: unknown format"),
    ("h.jsonl", b"\x80\x81\xfe\xff\x00binary\n", "h.jsonl:1: invalid"),
    ("i.txt", b"\xff\xfe\x00\x01", "i.txt"),
    ("j.jsonl", '{"text": "a"}\n{"text": "b"\n', "j.jsonl:2: invalid JSON"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_DATA, ids=[b[0] for b in BAD_DATA])
def test_bad_data_is_one_line_naming_the_file_from_the_launcher(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    code, err, _ = _cli(capsys, "--data", str(path), "--nproc", "2", "--out", str(tmp_path / "r"))
    assert code == 2 and err.startswith("sparsebalance train: error:"), err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()  # nothing launched, nothing left behind


def _cli(capsys, *argv):
    t0 = time.perf_counter()
    code = main(["train", *argv])
    _, err = capsys.readouterr()
    return code, err, time.perf_counter() - t0


def test_user_errors_are_one_line_exit_2_before_any_work(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n42\n')
    (tmp_path / "file").write_text("x")
    cases = [
        (["--resume", "--out", str(tmp_path / "missing")], "--resume: no checkpoint"),
        (["--nproc", "0", "--out", str(tmp_path / "r0")], "--nproc must be >= 1"),
        (["--out", str(tmp_path / "file")], "exists and is not a folder"),
        (
            ["--data", str(tmp_path / "bad.jsonl"), "--nproc", "2", "--out", str(tmp_path / "r1")],
            "bad.jsonl:2: not a JSON object",
        ),
        (["--model", str(tmp_path), "--out", str(tmp_path / "r2")], "--model"),
    ]
    for argv, message in cases:
        code, err, _ = _cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert err.startswith("sparsebalance train: error:") and message in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_a_live_run_in_the_folder_refuses_the_cli(tmp_path, capsys):
    with RunLock(tmp_path / "run"):
        code, err, _ = _cli(capsys, "--out", str(tmp_path / "run"), "--overwrite")
    assert code == 2 and "another run is live in this folder" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.timeout(600)  # one real training step: seconds alone, minutes on a loaded machine
@pytest.mark.filterwarnings("ignore:latency model. some inputs lie outside")
def test_overlong_split_trains_a_batch_of_only_overlong_documents(tmp_path):
    """Regression: ``--capacity 140`` with only longer documents stopped the run at step 3."""
    cfg = base_config(tmp_path, steps=1, capacity=40, overlong="split")  # documents: 48-93 tokens
    result = Trainer(cfg, Runtime(0, 1, torch.device("cpu"))).run()
    assert result["steps"] == 1
    assert all(s["num_overlong"] == cfg.global_batch for s in result["summaries"])
