"""How a training process ends when asked to: workers die with their launcher (Linux parent-death
signal), and SIGINT / SIGTERM stop a run cleanly.

Before the training loop a signal stops the process at once (nothing to save). Inside the loop
(:meth:`StopSignals.deferred`) the first signal only sets a flag: the ranks agree on it at the
next step boundary (:meth:`StopSignals.agreed`, one all-reduce), save a checkpoint and exit with
``128 + signal``; a second signal stops at once. Either way the process ends with one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """The run was stopped by a signal; ``exit_code`` is ``128 + signum``."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only; returns
    False elsewhere). Exits at once if the parent is already gone (it died before the request)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid() if expected_parent is None else expected_parent
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent died before the request: nobody will signal us
        os.kill(os.getpid(), sig)
    return True


class StopSignals:
    """Installs handlers for SIGINT, SIGTERM and SIGHUP (main thread only)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._deferred = False
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = signum
        if not (self._deferred and first):
            raise Stopped(signum, f"stopped by {signal.Signals(signum).name}")

    @contextlib.contextmanager
    def deferred(self):
        """Inside: the first signal only sets the flag (checked at step boundaries)."""
        self._deferred = True
        try:
            if self.signum is not None:  # arrived just before: honour it now
                raise Stopped(self.signum, f"stopped by {signal.Signals(self.signum).name}")
            yield self
        finally:
            self._deferred = False

    def agreed(self, rt) -> int | None:
        """The signal any rank received (all ranks call this at the same step), else None."""
        mine = self.signum or 0
        if not rt.distributed:
            return mine or None
        import torch
        import torch.distributed as dist

        flag = torch.tensor([mine], dtype=torch.int64, device=rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None
