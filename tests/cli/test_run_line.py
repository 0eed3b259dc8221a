"""``sparsebalance train`` says a run started (``== run: ... -> OUT``) only once its checks have
passed: a refused run prints no such line, only its one-line refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparsebalance.cli import main


class Launched(BaseException):
    """The ranks were about to start (``supervise``): nothing may be said to start before it."""


@pytest.fixture
def no_launch(monkeypatch):
    def supervise(*args, **kwargs):
        raise Launched

    monkeypatch.setattr("sparsebalance.train.launch.supervise", supervise)


def test_a_refused_run_never_says_it_started(tmp_path, capsys, no_launch):
    out = tmp_path / "my"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # an earlier run: refused without --resume
    code = main(["train", "--nproc", "1", "--steps", "2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    assert "== run" not in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"sparsebalance train: error: --out {out} holds")


def test_the_run_line_follows_the_checks(tmp_path, capsys, monkeypatch):
    said_before_checks = []

    def preflight(cfg, nproc, multinode=False, said=None):
        said_before_checks.append(capsys.readouterr().out)
        return None

    def write_report(out):
        report = Path(out) / "report.md"
        report.write_text("# report\n\nsummary\n")
        return report, {}

    monkeypatch.setattr("sparsebalance.train.launch.preflight", preflight)
    monkeypatch.setattr("sparsebalance.train.launch.supervise", lambda *a, **k: 0)
    monkeypatch.setattr("sparsebalance.commands.train.write_report", write_report)
    out = tmp_path / "my"
    assert main(["train", "--nproc", "1", "--steps", "2", "--out", str(out)]) == 0
    assert said_before_checks == [""]
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"== run: strategy=sab, dst=bidirectional, ranks=1, steps=2 -> {out}"
