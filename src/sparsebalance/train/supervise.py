"""Supervising a launched run: ``supervise`` runs torchrun (or the only rank) in its own session
and turns a first SIGINT/SIGTERM/SIGHUP into "finish the step, save, exit" for the ranks, waiting
up to ``--stop-grace`` seconds before it kills them (torchrun alone would after 30 s)."""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .signals import HANDLED

STOP_GRACE = 900.0
"""Seconds the launcher waits, after a first SIGINT/SIGTERM/SIGHUP, for the ranks to finish
their step and save (``--stop-grace``): longer than ``--comm-timeout``'s default, so a stalled
peer is reported by the ranks first; torchrun's own grace is 30 s."""


def add_stop_grace_argument(p) -> None:
    """``--stop-grace``: how long a stopped run may take to finish its step and save."""
    p.add_argument(
        "--stop-grace",
        type=float,
        default=STOP_GRACE,
        metavar="SECONDS",
        help="after a first SIGINT/SIGTERM/SIGHUP, how long the ranks may take to "
        "finish their step and save a checkpoint before they are killed (torchrun "
        "alone would kill them after 30 s)",
    )


def check_stop_grace(seconds: float) -> None:
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--stop-grace must be a finite number of seconds > 0, got {seconds}")


_STOP_GRACE = contextvars.ContextVar("stop_grace", default=STOP_GRACE)


def current_stop_grace() -> float:
    """The ``--stop-grace`` set by :func:`stop_grace` (else :data:`STOP_GRACE`)."""
    return _STOP_GRACE.get()


@contextlib.contextmanager
def stop_grace(seconds: float):
    """Inside it, :func:`launch` waits ``seconds`` for stopped ranks (``--stop-grace``) unless
    given its own ``stop_grace``: the command sets it once for every run it launches."""
    check_stop_grace(seconds)
    token = _STOP_GRACE.set(seconds)
    try:
        yield
    finally:
        _STOP_GRACE.reset(token)


def supervise(cmd: list[str], env: dict[str, str], stop_grace: float = STOP_GRACE, torchrun: bool = True) -> int:
    """Run ``cmd`` (torchrun, or with ``torchrun=False`` the only rank) in a new session and
    wait. Returns its exit code (``128 + signal`` if it was stopped or killed).

    The first SIGINT/SIGTERM/SIGHUP here goes to the ranks themselves (torchrun's children),
    never to torchrun: torchrun would forward it and SIGKILL them 30 s later, whatever their step
    or their save still needed. The ranks finish their step, save and exit; this process says in
    one line that it waits, up to ``stop_grace`` seconds, then kills them and says so. A second
    signal kills them at once (said too)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    received: list[int] = []
    expired = threading.Event()
    ranks: list[int] = []

    def kill() -> None:
        for pid in ranks:  # they would die with torchrun (parent-death signal); at once here
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def expire() -> None:
        expired.set()
        kill()

    timer = threading.Timer(stop_grace, expire)
    timer.daemon = True

    def forward(signum: int, frame) -> None:
        received.append(signum)
        if len(received) > 1:
            kill()
            return
        ranks.extend(children(proc.pid) if torchrun else [])
        for pid in ranks or [proc.pid]:  # none yet (torchrun starting them): torchrun's way
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        # at the start of a line: rank 0's progress bar may be half drawn on this terminal
        _say(
            f"{signal.Signals(signum).name}: the ranks finish their step and save a checkpoint; "
            f"waiting up to {stop_grace:g} s (--stop-grace), a second signal kills them now",
            start="\r\033[K" if sys.stderr.isatty() else "\r",
        )
        timer.start()

    previous = {sig: signal.signal(sig, forward) for sig in HANDLED}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        timer.cancel()
    rc = 128 - rc if rc < 0 else rc
    return _stopped_code(rc, received, expired.is_set(), stop_grace)


def _stopped_code(rc: int, received: list[int], expired: bool, stop_grace: float) -> int:
    """:func:`supervise`'s exit code once the ranks ended after ``received`` signals: ``128 +
    the first signal`` where they were killed (said in one line), else their own ``rc``."""
    if not received or rc == 0:
        return rc
    name = signal.Signals(received[0]).name
    if expired:
        _say(
            f"the ranks did not stop within --stop-grace {stop_grace:g} s of {name}: killed; "
            "--resume continues from the last checkpoint saved"
        )
    elif len(received) > 1 and rc == 128 + signal.SIGKILL:
        _say(
            f"a second {signal.Signals(received[1]).name}: the ranks were killed; --resume "
            "continues from the last checkpoint saved"
        )
    else:
        return rc  # the ranks stopped, saved and said so (or failed and said why)
    return 128 + received[0]


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return sorted(found)


def _say(line: str, start: str = "") -> None:
    print(f"{start}sparsebalance train: {line}", file=sys.stderr, flush=True)
