"""The run-folder lock: a dead but unreaped launcher (zombie) does not hold it; two launchers that
both find a stale lock cannot both take it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparsebalance.train.runlock import LOCK_NAME, Owner, RunLock, RunLockError, process_start

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs /proc")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _write_lock(run: Path, owners: list[dict], token: str = "t") -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / LOCK_NAME).write_text(json.dumps({"token": token, "since": 0, "owners": owners}))


def test_a_zombie_launcher_does_not_hold_the_lock(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # not waited on: a zombie
    try:
        for _ in range(500):  # until it has exited (bounded: 10 s)
            if _state(child.pid) == "Z":
                break
            time.sleep(0.02)
        assert _state(child.pid) == "Z"
        os.kill(child.pid, 0)  # what fooled the old check: the pid still "exists"
        me = {"host": socket.gethostname(), "pid": child.pid, "start": process_start(child.pid)}
        assert not Owner(**me).alive()
        _write_lock(tmp_path / "run", [me])
        with RunLock(tmp_path / "run") as lock:
            assert lock.note is not None and f"pid {child.pid}" in lock.note
    finally:
        child.wait()


def test_a_live_owner_still_holds_it(tmp_path):
    me = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}
    assert Owner(**me).alive()
    _write_lock(tmp_path / "run", [me])
    with pytest.raises(RunLockError, match="another run is live"):
        RunLock(tmp_path / "run").acquire()


def test_two_takers_of_one_stale_lock_cannot_both_win(tmp_path, monkeypatch):
    run = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(run, [{"host": socket.gethostname(), "pid": dead.pid, "start": None}])
    live = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}
    real_rename = os.rename

    def rename_after_the_other_taker(src, dst):
        # Both launchers judged the lock stale; the other one renamed it away and created its
        # fresh lock just before this launcher's rename, which now moves the fresh one.
        if Path(src).name == LOCK_NAME and not list(run.glob(f"{LOCK_NAME}.stale-*")):
            (run / LOCK_NAME).unlink()
            _write_lock(run, [live], token="other")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_after_the_other_taker)
    with pytest.raises(RunLockError, match="another run took over this folder's stale lock"):
        RunLock(run).acquire()
    monkeypatch.undo()
    held = json.loads((run / LOCK_NAME).read_text())
    assert held["token"] == "other"  # the winner's lock is back in place
    assert not list(run.glob(f"{LOCK_NAME}.stale-*"))
    with pytest.raises(RunLockError, match="another run is live"):
        RunLock(run).acquire()  # and it holds the folder
