"""One run per folder: ``<out>/run.lock`` names the processes that own the run (host, pid and the
process' start time). A second run refuses while any of them is alive; a lock whose processes
are all gone (``kill -9``, a crashed node on this host) is stale and is taken over, said in one
line. Locks held from another host are never taken over automatically (their liveness cannot be
checked from here): the message says which host and pid hold it and how to clear it.

The launcher (``sparsebalance train``) takes the lock and passes its token to its workers in
``SPARSEBALANCE_RUN_LOCK``; rank 0 then adds its own pid (:func:`join`), so the lock stays live
while a worker outlives its launcher for a moment (finishing its step). A worker started by a
user's own ``torchrun`` takes the lock itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

LOCK_NAME = "run.lock"
FOLLOW = "follow-node-0"
"""``SPARSEBALANCE_RUN_LOCK`` on nodes other than 0: join the lock node 0's launcher holds
(torchrun's c10d rendezvous may place global rank 0 on any node; ``--out`` is shared)."""
ENV_TOKEN = "SPARSEBALANCE_RUN_LOCK"


@dataclass(frozen=True)
class Owner:
    """A process that holds the lock."""

    host: str
    pid: int
    start: str | None
    """The process' start time (``/proc/<pid>/stat`` field 22) so a reused pid is not mistaken
    for the owner; None where ``/proc`` is not available."""

    @classmethod
    def this_process(cls) -> Owner:
        return cls(socket.gethostname(), os.getpid(), process_start(os.getpid()))

    def alive(self) -> bool:
        """False only when this process certainly no longer runs (same host, pid gone, reused,
        or a zombie: dead, only not yet reaped by its parent)."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)  # succeeds for a zombie too
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by another user
            pass
        stat = _proc_stat(self.pid)
        if stat is None:  # no /proc: the pid exists, nothing more to check
            return True
        state, start = stat[0], stat[19]
        if state in ("Z", "X"):  # zombie / dead: exited, its parent has not waited on it
            return False
        return self.start is None or start == self.start


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, first), or
    None without ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and ")"


def process_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot, or None without ``/proc``."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[19]  # field 22


class RunLockError(ValueError):
    """Another run holds the folder (a user error: exit 2, one line)."""


class RunLock:
    """``with RunLock(out) as lock:`` holds ``out/run.lock`` for the block (created if needed)."""

    def __init__(self, run_dir: Path, token: str | None = None) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.token = token or uuid.uuid4().hex
        self.note: str | None = None
        """Set by :meth:`acquire` when a stale lock was taken over (the line to print)."""
        self._held = False

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"token": self.token, "since": time.time(), "owners": [asdict(Owner.this_process())]}
        for _ in range(5):
            if _create(self.path, record):
                self._held = True
                return self
            if not self.path.exists():  # released meanwhile: try again
                continue
            held = read(self.path) or {}  # written atomically: unreadable means corrupt, stale
            owners = _owners(held)
            live = [o for o in owners if o.alive()]
            if live:
                o = live[0]
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.get("since", 0)))
                hint = "" if o.host == socket.gethostname() else f"; if no run is live on {o.host}, delete {self.path}"
                raise RunLockError(
                    f"--out {self.path.parent}: another run is live in this folder (pid {o.pid} "
                    f"on {o.host}, since {since}){hint}"
                )
            gone = ", ".join(f"pid {o.pid}" for o in owners) or "no process"
            stale = self.path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(self.path, stale)  # only one of several racing takers wins
            except FileNotFoundError:
                continue
            if read(stale) != (held or None):
                # Not the lock judged stale: another launcher took the stale one over between
                # our read and our rename, and this moved its fresh lock. Put it back, refuse.
                with contextlib.suppress(FileExistsError):
                    os.link(stale, self.path)
                stale.unlink(missing_ok=True)
                raise RunLockError(
                    f"--out {self.path.parent}: another run took over this folder's stale lock "
                    "at the same moment; it is live now"
                )
            stale.unlink(missing_ok=True)
            self.note = f"took over a stale lock in {self.path.parent} ({gone}: not running)"
        if not self._held:
            raise RunLockError(f"--out {self.path.parent}: could not take {self.path}")
        return self

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if self._held:
            held = read(self.path)
            if held is not None and held.get("token") == self.token:
                self.path.unlink(missing_ok=True)
            self._held = False

    def __enter__(self) -> RunLock:
        return self.acquire() if not self._held else self

    def __exit__(self, *exc) -> None:
        self.release()


def _create(path: Path, record: dict) -> bool:
    """Create ``path`` holding ``record`` atomically; False if it exists."""
    tmp = path.with_name(f".{LOCK_NAME}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(record) + "\n")
    try:
        os.link(tmp, path)  # atomic, fails if the lock exists (also on NFS)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _owners(held: dict) -> list[Owner]:
    try:
        return [Owner(**o) for o in held.get("owners", [])]
    except TypeError:  # not a lock this code wrote: nobody to wait for
        return []


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def join(run_dir: Path, token: str) -> bool:
    """Add this process to the lock whose token is ``token`` (a launcher's worker); False if the
    lock is not that launcher's (then the caller must take it itself)."""
    path = Path(run_dir) / LOCK_NAME
    held = read(path)
    if held is not None and token == FOLLOW:
        token = held.get("token", "")
    if held is None or held.get("token") != token:
        return False
    held["owners"].append(asdict(Owner.this_process()))
    tmp = path.with_name(f".{LOCK_NAME}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(held) + "\n")
    os.replace(tmp, path)
    return True
