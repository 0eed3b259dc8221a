"""One writer per store: the ``.NAME.lock`` beside it (``flock``, released by the kernel when the
writer dies), the temporary folders a writer writes under and the sweep of those a killed writer
left, and ``fsync`` of a folder. Used by :class:`~.store.StoreWriter`; the cache waits on the lock
with :func:`wait_for_writer`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import time
from pathlib import Path


class StoreBusy(ValueError):
    """Another process is writing the same store."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


STALE_ELSEWHERE_SECONDS = 24 * 3600
"""A temporary folder of another host (or of a name without one) is removed only when nothing in
it changed for this long: its writer's pid cannot be checked from here (a shared cache)."""


def _temporary_name(path: Path) -> str:
    """``.NAME.tmp-HOST-PID-RANDOM``: the writer's host and pid, so a sweep on another host of a
    shared cache can tell it is not its own."""
    return f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False


def sweep_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove temporary folders beside ``path`` left by a writer that was killed (SIGKILL, power
    loss: no ``__exit__`` ran).

    A folder written on this host is removed when its writer's pid is gone; one written on
    another host (a cache shared over NFS) or named without a host (an earlier version) when none
    of its files changed for :data:`STALE_ELSEWHERE_SECONDS`, since a pid of another host means
    nothing here. A live writer's folder is kept. Returns the removed folders."""
    path = Path(path)
    removed = []
    here = socket.gethostname()
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        parts = tmp.name[len(f".{path.name}.tmp-") :].rsplit("-", 2)
        if not tmp.is_dir() or not parts[-2].isdigit():
            continue
        host = parts[0] if len(parts) == 3 else None
        if host == here:
            stale = _pid_gone(int(parts[-2]))
        else:
            newest = max((f.stat().st_mtime for f in tmp.rglob("*")), default=0.0)
            stale = time.time() - max(newest, tmp.stat().st_mtime) > STALE_ELSEWHERE_SECONDS
        if stale:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _lock_path(path: Path) -> Path:
    return path.parent / f".{path.name}.lock"


def _holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"]))
        return f"pid {h['pid']} on {h['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):  # written a moment later
        return "another process"


def _take_lock(path: Path) -> int | None:
    """Hold ``.NAME.lock`` beside the store; returns its descriptor (None on a filesystem without
    locks: then only the no-replace rename guards the store). Raises :class:`StoreBusy`."""
    lock = _lock_path(path)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StoreBusy(
                f"{path}: another prepare is writing this token store ({holder}): wait for it "
                "to finish; two writers of one store cannot both succeed",
                holder,
            ) from None
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP):
                lock.unlink(missing_ok=True)  # nobody can hold a lock here
                return None
            raise
        try:  # the holder before us removes the file as it releases: lock the one now there
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError:
        _release_lock(path, fd)
        raise
    return fd


def _release_lock(path: Path, fd: int | None) -> None:
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(_lock_path(path))  # before unlocking: a later writer creates a new file
    os.close(fd)


def wait_for_writer(path: str | Path) -> None:
    """Block until no process writes the store at ``path`` (returns at once when none does)."""
    try:
        fd = os.open(_lock_path(Path(path)), os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:  # no locks on this filesystem: nothing to wait on
        pass
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
