"""Issue 55, item 1: the demo's two runs share one launch and step in turn on the same samples
(step 1 of each, then step 2 of each, the order alternating), so a change in the machine's load
lands on both. Each run keeps its own folder, metrics, checkpoint and report line; stepped in
turn, two trainers in one process train exactly what they train alone."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sparsebalance.cli import main
from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import Trainer
from sparsebalance.train.interleave import run_interleaved
from sparsebalance.train.runlock import ENV_TOKEN, LOCK_NAME
from tests.train.harness import base_config

CPU1 = Runtime(0, 1, torch.device("cpu"))
pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


def _steps(run: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["rank"] == "all"]


@pytest.mark.timeout(600)  # four short runs: seconds alone
def test_runs_stepped_in_turn_train_what_they_train_alone(tmp_path):
    base = base_config(tmp_path, steps=3)
    a, b = replace(base, strategy="sequential"), replace(base, strategy="sab")
    alone = [Trainer(replace(c, out=str(tmp_path / f"alone-{c.strategy}")), CPU1).run() for c in (a, b)]
    together = [Trainer(replace(c, out=str(tmp_path / f"turn-{c.strategy}")), CPU1) for c in (a, b)]
    results = run_interleaved(together)
    for mine, solo in zip(results, alone, strict=True):
        assert mine["losses"] == solo["losses"] and mine["steps"] == 3
    for c in (a, b):
        run = tmp_path / f"turn-{c.strategy}"
        assert [s["step"] for s in _steps(run)] == [1, 2, 3] and _steps(run)[0]["strategy"] == c.strategy
        assert (run / "checkpoints" / "step-000003").is_dir() and (run / "config.json").is_file()
    with pytest.raises(ValueError, match=r"interleaved runs need the same --steps, got \[2, 3\]"):
        run_interleaved([Trainer(replace(a, steps=2, out=str(tmp_path / "x")), CPU1), together[1]])


def test_the_demo_is_one_launch_of_both_runs(tmp_path, monkeypatch, capsys):
    """One worker command for both runs (``--config BASELINE --interleave SPARSEBALANCE``), both
    folders checked and locked first, the machine recorded beside them."""
    commands = []

    def supervise(cmd, env, grace, torchrun):
        commands.append(cmd)
        for run in ("baseline", "sparsebalance"):  # both folders held under the token the ranks get
            held = json.loads((tmp_path / "demo" / run / LOCK_NAME).read_text())
            assert held["token"] == env[ENV_TOKEN]
        return 0

    monkeypatch.setattr("sparsebalance.train.launch.supervise", supervise)
    monkeypatch.setattr("sparsebalance.commands.train.write_report", lambda out: (_fake_report(out), {}))
    assert main(["train", "--demo", "--nproc", "2", "--steps", "3", "--out", str(tmp_path / "demo")]) == 0
    (cmd,) = commands
    worker = cmd[cmd.index("sparsebalance.train") + 1 :]
    assert worker == [
        "--config",
        str(tmp_path / "demo" / "baseline" / "launch-config.json"),
        "--interleave",
        str(tmp_path / "demo" / "sparsebalance" / "launch-config.json"),
    ]
    machine = json.loads((tmp_path / "demo" / "machine.json").read_text())
    assert machine["ranks"] == 2 and machine["device"] == "cpu" and {"load_start", "load_end"} <= set(machine)
    out = capsys.readouterr().out.splitlines()
    assert [x.split(":")[0] for x in out[:2]] == ["== baseline", "== sparsebalance"]


def test_the_demo_with_pipelines_runs_sab(tmp_path):
    from sparsebalance.train.demo import demo_configs

    runs = demo_configs(base_config(tmp_path, pp=2, strategy="sab"))
    assert runs["sparsebalance"].strategy == "sab" and runs["sparsebalance"].dst.mode == "bidirectional"
    assert demo_configs(base_config(tmp_path))["sparsebalance"].strategy == "sab-cp"


def _fake_report(out) -> Path:
    report = Path(out) / "report.md"
    report.write_text("# report\n\nsummary\n")
    return report


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_the_demo_says_its_verdict_and_machine(tmp_path, capsys):
    assert main(["train", "--demo", "--steps", "4", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "| baseline |" in out and "| sparsebalance |" in out
    (verdict,) = [x for x in out.splitlines() if x.startswith("Verdict: ")]
    assert "x the baseline's speed (95 % interval " in verdict and "3 step pairs" in verdict
    assert any(x.startswith("Machine: 2 cores, cpu, 2 ranks; load (1 min) ") for x in out.splitlines())
    report = (tmp_path / "demo" / "report.md").read_text()
    assert verdict in report
    for run in ("baseline", "sparsebalance"):
        assert [s["step"] for s in _steps(tmp_path / "demo" / run)] == [1, 2, 3, 4]
