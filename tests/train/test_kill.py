"""Killing a real ``sparsebalance train --nproc 2`` (subprocesses, bounded by timeouts): workers
die with their launcher, a second run refuses while one is live, SIGTERM stops with one line and
a checkpoint (also during a step longer than torchrun's own grace), a full disk while saving is
one line and the run resumes from the checkpoint before, and ``--resume`` after ``kill -9``
reproduces the uninterrupted run's losses.

Faults inside the ranks (a full disk, a long step) are planted by a ``sitecustomize`` module on
the ranks' ``PYTHONPATH`` (:func:`_faulty_env`), so the run under test is the real command."""

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
    return [
        sys.executable,
        "-m",
        "sparsebalance",
        "train",
        "--nproc",
        "2",
        "--data",
        str(tmp / "data.jsonl"),
        "--profile",
        str(tmp / "profile.json"),
        "--out",
        str(out),
        "--steps",
        "5",
        "--global-batch",
        "8",
        "--capacity",
        "512",
        "--block-size",
        "32",
        "--device",
        "cpu",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "0",
        "--schedule",
        "constant",
        "--deterministic",
        "--checkpoint-every",
        "1",
        "--dst-mode",
        "bidirectional",
        "--gamma0",
        "0.9",
        "--gamma-min",
        "0.5",
        "--gamma-max",
        "0.99",
        *extra,
    ]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": SRC, "PYTHONWARNINGS": "ignore"}


FAULTS = """
import os

FAULT = os.environ.get("SPARSEBALANCE_TEST_FAULT")
if FAULT == "disk-full":  # the disk fills 100 bytes into step 2's model.pt
    import errno
    import pathlib

    real_open = pathlib.Path.open

    class Full:
        def __init__(self, f, room):
            self._f, self._room = f, room

        def write(self, data):
            n = len(data) if isinstance(data, str) else memoryview(data).nbytes
            if n > self._room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._room -= n
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def full_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        step_2 = path.parent.name.startswith(".step-000002.tmp") and path.name == "model.pt"
        return Full(f, 100) if "w" in mode and step_2 else f

    pathlib.Path.open = full_open
elif FAULT == "long-step" and "TORCHELASTIC_RUN_ID" in os.environ:
    # step 2 runs until the rank is asked to stop, then HOLD seconds more (a long document);
    # each rank marks when it is inside it
    import pathlib
    import time

    from sparsebalance.train.trainer import Trainer

    real_step = Trainer.run_step
    HOLD = float(os.environ["SPARSEBALANCE_TEST_HOLD"])
    MARK = pathlib.Path(os.environ["SPARSEBALANCE_TEST_MARK"])

    def long_step(self):
        result = real_step(self)
        if self.step == 2:
            (MARK / f"in-step-2-rank-{self.rt.rank}").write_text("")
            while self.stops is None or self.stops.signum is None:
                time.sleep(0.05)
            time.sleep(HOLD)
        return result

    Trainer.run_step = long_step
"""


def _faulty_env(tmp: Path, fault: str, **extra: str) -> dict:
    """:func:`_env` with ``fault`` planted in every process of the run."""
    (tmp / "faults").mkdir(exist_ok=True)
    (tmp / "faults" / "sitecustomize.py").write_text(FAULTS)
    return {**_env(), "PYTHONPATH": f"{SRC}{os.pathsep}{tmp / 'faults'}", "SPARSEBALANCE_TEST_FAULT": fault, **extra}


def _our_lines(err: str) -> list[str]:
    """The run's own lines on stderr, without the startup line saying what the budget keeps."""
    return [
        x
        for x in err.replace("\r", "\n").splitlines()
        if x.startswith("sparsebalance") and not x.startswith("sparsebalance train: budget:")
    ]


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
@pytest.mark.parametrize(
    "layout", [(), ("--pp", "2"), ("--pp", "2", "--pp-virtual", "2")], ids=["dp2", "pp2", "pp2-v2"]
)
def test_kill_9_of_the_launcher_kills_the_workers_and_resume_matches(data, layout):
    """The killed run is started for far more steps than it can train before the kill, so it
    is always killed mid-run (with --steps 5 it could finish first, and --resume then found a
    complete run); it is resumed, and compared with a reference run, to 2 steps past the kill:
    the constant LR does not depend on --steps, which may change on --resume. ``pp2``: the two
    processes are one pipeline of two stages (issue 44); ``pp2-v2``: of two stages holding two
    chunks each, interleaved 1F1B (issue 54)."""
    out = data / "killed"
    log = (data / "killed.log").open("w")
    many = ("--steps", "1000", *layout)
    proc = subprocess.Popen(
        _argv(data, out, *many), env=_env(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=log
    )
    try:
        _wait_for_step(out, 2, proc)
        second = subprocess.run(
            _argv(data, out, *many, "--resume"), env=_env(), capture_output=True, text=True, timeout=300
        )
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
    steps = ("--steps", str(killed_at + 2), *layout)
    ref = subprocess.run(_argv(data, data / "ref", *steps), env=_env(), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    resumed = subprocess.run(
        _argv(data, out, *steps, "--resume"), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step-" in resumed.stderr
    want, got = _losses(data / "ref"), _losses(out)
    assert sorted(got) == list(range(1, killed_at + 3))
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_sigterm_stops_with_one_line_and_a_checkpoint(data):
    out = data / "run"
    log = data / "run.log"
    proc = subprocess.Popen(
        _argv(data, out, "--steps", "50"),
        env=_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    try:
        _wait_for_step(out, 1, proc)
        proc.send_signal(signal.SIGTERM)  # the CLI alone: it forwards to torchrun -> ranks
        proc.wait(timeout=300)
        err = log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    ours = _our_lines(err)
    assert len(ours) == 2, err[-2000:]  # the launcher waits, the ranks stop
    assert ours[0].startswith("sparsebalance train: SIGTERM: the ranks finish their step")
    assert "stopped by SIGTERM after step" in ours[1], err[-2000:]
    assert "Traceback" not in err
    step = int(ours[1].split("after step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"step-{step:06d}" / "checksums.json").is_file()
    assert max(_losses(out)) == step
    assert not _workers(out) and not (out / "run.lock").exists()


@pytest.mark.slow
def test_sigterm_during_a_step_longer_than_torchruns_grace_still_saves(data):
    """Issue 45: torchrun SIGKILLed the ranks 30 s after the launcher forwarded SIGTERM to it,
    whatever their step still needed: exit 143, no line, the step lost. torchrun's grace is cut
    to 2 s here (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) and step 2 goes on for 8 s after the signal;
    the launcher now signals the ranks itself and waits for them (--stop-grace)."""
    out = data / "run"
    log = data / "run.log"
    env = _faulty_env(
        data,
        "long-step",
        SPARSEBALANCE_TEST_HOLD="8",
        SPARSEBALANCE_TEST_MARK=str(data),
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2",
    )
    proc = subprocess.Popen(
        _argv(data, out, "--steps", "50"),
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    try:
        inside = [data / f"in-step-2-rank-{r}" for r in range(2)]
        while not all(f.exists() for f in inside):  # both ranks in step 2 (bounded: timeout)
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        err = log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    ours = _our_lines(err)
    assert len(ours) == 2 and "waiting up to 900 s (--stop-grace)" in ours[0], err[-2000:]
    assert ours[1] == (
        "sparsebalance train: stopped by SIGTERM after step 2: checkpoint step-000002 saved, continue with --resume"
    ), err[-2000:]
    assert "Traceback" not in err
    assert (out / "checkpoints" / "step-000002" / "checksums.json").is_file()
    assert max(_losses(out)) == 2
    assert not _workers(out) and not (out / "run.lock").exists()


@pytest.mark.slow
def test_a_full_disk_while_saving_is_one_line_and_resume_continues(data):
    """Issue 45: torch's ``unexpected pos`` RuntimeError, uncaught, a traceback from each rank,
    exit 1, no word of disk space. The disk fills while step 2's checkpoint is written."""
    out = data / "run"
    full = subprocess.run(
        _argv(data, out), env=_faulty_env(data, "disk-full"), capture_output=True, text=True, timeout=600
    )
    err = full.stderr
    assert full.returncode == 2, err[-2000:]
    ours = _our_lines(err)
    assert len(ours) == 1, err[-2000:]
    assert ours[0].startswith(
        f"sparsebalance train: error: checkpoint step-000002: no space left in {out / 'checkpoints'} (disk full"
    ), ours
    assert "step-000001 is intact" in ours[0] and "Traceback" not in err
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert not _workers(out) and not (out / "run.lock").exists()
    resumed = subprocess.run(_argv(data, out, "--resume"), env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step-000001" in resumed.stderr
    assert sorted(_losses(out)) == [1, 2, 3, 4, 5]
