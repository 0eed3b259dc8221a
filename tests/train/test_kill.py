"""Killing a real ``sparsebalance train --nproc 2`` (subprocesses, bounded by timeouts): workers
die with their launcher, a second run refuses while one is live, SIGTERM stops with one line and
a checkpoint, and ``--resume`` after ``kill -9`` reproduces the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.harness import write_dataset, write_profile

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _argv(tmp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sparsebalance", "train", "--nproc", "2",
            "--data", str(tmp / "data.jsonl"), "--profile", str(tmp / "profile.json"),
            "--out", str(out), "--steps", "5", "--global-batch", "8", "--capacity", "512",
            "--block-size", "32", "--device", "cpu", "--lr", "3e-3", "--warmup-steps", "0",
            "--schedule", "constant", "--deterministic", "--checkpoint-every", "1", "--dst-mode",
            "bidirectional", "--gamma0", "0.9", "--gamma-min", "0.5", "--gamma-max", "0.99",
            *extra]  # fmt: skip


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": SRC, "PYTHONWARNINGS": "ignore"}


def _losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if r["rank"] == "all"]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["loss"] for r in recs if r["rank"] == "all"}


def _wait_for_step(out: Path, step: int, proc, timeout: float = 600) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, "the run ended before it could be killed"
        if (out / "metrics.jsonl").is_file() and len(_losses_lenient(out)) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} after {timeout} s")


def _losses_lenient(out: Path) -> list:
    return [x for x in (out / "metrics.jsonl").read_text().split("\n") if '"rank": "all"' in x]


def _workers(out: Path) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if f"{out}/launch-config.json" in line]


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` (from ``/proc``'s parent links), whatever its command
    line shows: a command line can read empty for a moment, a pid cannot."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it can write nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(out: Path, pids: set[int] = frozenset(), timeout: float = 120) -> float:
    """Until no process of the run is left: none whose command line names ``out``'s launch
    config, and none of ``pids`` (the launcher's tree, taken while it ran)."""
    t0 = time.monotonic()
    while _workers(out) or any(map(_alive, pids)):
        left = _workers(out) or sorted(filter(_alive, pids))
        assert time.monotonic() - t0 < timeout, f"still running: {left}"
        time.sleep(0.2)
    return time.monotonic() - t0


@pytest.fixture
def data(tmp_path):
    write_dataset(tmp_path)
    write_profile(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_kill_9_of_the_launcher_kills_the_workers_and_resume_matches(data):
    """The killed run is started for far more steps than it can train before the kill, so it
    is always killed mid-run (with --steps 5 it could finish first, and --resume then found a
    complete run); it is resumed, and compared with a reference run, to 2 steps past the kill:
    the constant LR does not depend on --steps, which may change on --resume."""
    out = data / "killed"
    log = (data / "killed.log").open("w")
    many = ("--steps", "1000")
    proc = subprocess.Popen(_argv(data, out, *many), env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=log)  # fmt: skip
    try:
        _wait_for_step(out, 2, proc)
        second = subprocess.run(_argv(data, out, *many, "--resume"), env=_env(),
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert second.returncode == 2 and "another run is live" in second.stderr
        tree = _descendants(proc.pid)  # torchrun, both ranks and anything they started
        assert len(tree) >= 3, tree
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's whole process group, as in the issue
        proc.wait(timeout=60)
        _wait_gone(out, tree)  # torchrun and both ranks: nothing keeps writing to the folder
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    killed_at = max(_losses(out))
    time.sleep(2)
    assert max(_losses(out)) == killed_at  # nobody writes after the kill
    steps = ("--steps", str(killed_at + 2))
    ref = subprocess.run(_argv(data, data / "ref", *steps), env=_env(), capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-2000:]
    resumed = subprocess.run(_argv(data, out, *steps, "--resume"), env=_env(),
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step-" in resumed.stderr
    want, got = _losses(data / "ref"), _losses(out)
    assert sorted(got) == list(range(1, killed_at + 3))
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_sigterm_stops_with_one_line_and_a_checkpoint(data):
    out = data / "run"
    log = data / "run.log"
    proc = subprocess.Popen(_argv(data, out, "--steps", "50"), env=_env(),
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"))  # fmt: skip
    try:
        _wait_for_step(out, 1, proc)
        proc.send_signal(signal.SIGTERM)  # the CLI alone: it forwards to torchrun -> ranks
        proc.wait(timeout=300)
        err = log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM
    ours = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("sparsebalance")
            and not x.startswith("sparsebalance train: budget:")]  # the startup line  # fmt: skip
    assert len(ours) == 1 and "stopped by SIGTERM after step" in ours[0], err[-2000:]
    assert "Traceback" not in err
    step = int(ours[0].split("after step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"step-{step:06d}" / "checksums.json").is_file()
    assert max(_losses(out)) == step
    assert not _workers(out) and not (out / "run.lock").exists()
