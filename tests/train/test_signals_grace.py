"""The launcher's stop (issue 45): a first SIGTERM goes to the ranks themselves, not to torchrun,
and the launcher waits ``--stop-grace`` seconds for them to finish their step and save, saying
so in one line; past the grace, or at a second signal, it kills them and says that too.

torchrun is stood in for by a small process that starts two "ranks" in sessions of their own, as
torchrun does, and on a signal of its own does what torchrun does once its 30 s grace is over:
forwards it and kills its ranks. A rank trains until it gets SIGTERM, then finishes its step
(writes ``saved-N``) or, as a step that never ends, hangs. Nothing here waits on a clock: a
rank finishes or hangs whatever the time, and a test signals only once the ranks are ready."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from sparsebalance.train import supervise

pytestmark = pytest.mark.timeout(120)

RANK = """
import ctypes, os, signal, sys, time
from pathlib import Path

tmp, index, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # dies with its torchrun, as a rank does
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
(tmp / f"ready-{index}").write_text(str(os.getpid()))
while not got:  # training
    time.sleep(0.01)
(tmp / f"got-{index}").write_text("")
while mode == "hangs":  # a step that never ends
    time.sleep(1)
(tmp / f"saved-{index}").write_text("")  # the step ends and the checkpoint is saved
sys.exit(128 + signal.SIGTERM)
"""

TORCHRUN = """
import os, signal, subprocess, sys

tmp, mode, rank = sys.argv[1], sys.argv[2], sys.argv[3]
ranks = [subprocess.Popen([sys.executable, "-c", rank, tmp, str(i), mode],
                          start_new_session=True) for i in range(2)]

def grace_over(signum, frame):  # what torchrun does 30 s after it forwards a signal
    for p in ranks:
        os.kill(p.pid, signum)
        os.kill(p.pid, signal.SIGKILL)
    sys.exit(128 + signum)

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, grace_over)
sys.exit(max(128 - rc if rc < 0 else rc for rc in [p.wait() for p in ranks]))
"""


def _cmd(tmp: Path, mode: str) -> list[str]:
    return [sys.executable, "-c", TORCHRUN, str(tmp), mode, RANK]


def _signal_when(files: list[Path], signals: int = 1) -> threading.Thread:
    """A thread that sends SIGTERM to this process once every file in ``files`` exists (the
    signal handler runs in the main thread, inside ``supervise``)."""

    def wait_then_signal() -> None:
        while not all(f.exists() for f in files):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=wait_then_signal, daemon=True)
    thread.start()
    return thread


def _lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def _gone(tmp: Path) -> bool:
    """Once both ranks are dead (a zombie counts: it can do nothing more); a SIGKILL sent is
    done when the rank is next scheduled, so this waits for it (bounded by the test's
    timeout)."""
    pids = [int((tmp / f"ready-{i}").read_text()) for i in range(2)]
    while any(map(_alive, pids)):
        time.sleep(0.01)
    return True


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks found through /proc")
def test_the_ranks_finish_their_step_and_save_however_long_it_takes(tmp_path, capsys):
    """Before: the launcher forwarded SIGTERM to torchrun, which killed the ranks when its own
    grace ran out (30 s) with their step unfinished: exit 143, no checkpoint, no line."""
    _signal_when([tmp_path / "ready-0", tmp_path / "ready-1"])
    rc = supervise.supervise(_cmd(tmp_path, "saves"), dict(os.environ), stop_grace=600)
    assert rc == 128 + signal.SIGTERM
    assert (tmp_path / "saved-0").exists() and (tmp_path / "saved-1").exists()
    lines = _lines(capsys)
    assert len(lines) == 1, lines  # the ranks' own line ("stopped by SIGTERM ...") is theirs
    assert lines[0].startswith(
        "sparsebalance train: SIGTERM: the ranks finish their step and save a checkpoint; "
        "waiting up to 600 s (--stop-grace)"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks found through /proc")
def test_ranks_that_do_not_stop_within_the_grace_are_killed_and_it_is_said(tmp_path, capsys):
    _signal_when([tmp_path / "ready-0", tmp_path / "ready-1"])
    rc = supervise.supervise(_cmd(tmp_path, "hangs"), dict(os.environ), stop_grace=0.5)
    assert rc == 128 + signal.SIGTERM
    lines = _lines(capsys)
    assert len(lines) == 2, lines
    assert lines[1] == (
        "sparsebalance train: the ranks did not stop within --stop-grace 0.5 s of SIGTERM: "
        "killed; --resume continues from the last checkpoint saved"
    )
    assert not (tmp_path / "saved-0").exists() and _gone(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks found through /proc")
def test_a_second_signal_kills_at_once_and_it_is_said(tmp_path, capsys):
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    _signal_when(ready)
    _signal_when([*ready, tmp_path / "got-0", tmp_path / "got-1"])  # once they have the first
    rc = supervise.supervise(_cmd(tmp_path, "hangs"), dict(os.environ), stop_grace=600)
    assert rc == 128 + signal.SIGTERM
    lines = _lines(capsys)
    assert len(lines) == 2, lines
    assert lines[1] == (
        "sparsebalance train: a second SIGTERM: the ranks were killed; --resume continues from "
        "the last checkpoint saved"
    )
    assert _gone(tmp_path)


def test_children_are_the_direct_children_only(tmp_path):
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in supervise.children(os.getpid())
        assert supervise.children(child.pid) == []
    finally:
        child.kill()
        child.wait()
