"""Where this rank waits, so that a hang becomes one line instead of a silent wait.

The step (:mod:`sparsebalance.engine.step`) says which training step runs, the executor which CP
unit, the ring which of its steps; a transfer that does not complete in ``--comm-timeout``
seconds raises :class:`CommTimeout` with

    rank 0 waiting in unit 3, ring step 1, step 12: no message from rank 1 within 30 s
    (--comm-timeout): it is stalled or has died

and a collective that fails inside :func:`at` (the plan agreement, the gradient sync, the
runtime's barrier / object collectives) the same, naming the collective::

    rank 0 waiting in the plan agreement (all_gather_object), step 2: no message from rank 1
    within 5 s (--comm-timeout): it is stalled or has died

The backend's own text (gloo's ``[.../unbound_buffer.cc:129] Timed out waiting 5000ms for send
operation to complete``) is read for what happened (a timeout, a closed connection) and left
out; it stays the exception's cause.

- gloo (CPU): ``Work.wait(timeout)`` blocks the host, so the wait itself times out.
- NCCL (CUDA): ``Work.wait()`` only makes the compute stream wait and returns, so a host timeout
  cannot be put there without a host sync per transfer. Instead every ring wait records a CUDA
  event on the compute stream (:class:`DeviceWaits`); a watchdog thread finds the first wait whose
  event has not completed ``timeout`` seconds after it was issued, prints that position's line
  and ends the process (the launcher then stops its peers). The communicators also carry the
  timeout, so NCCL's own watchdog aborts collectives that hang elsewhere.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any


class CommTimeout(RuntimeError):
    """A rank waited longer than ``--comm-timeout`` (the message says where)."""


@dataclass(frozen=True)
class Position:
    """What this process is doing: training step, CP unit (slot), ring step."""

    step: int | None = None
    unit: int | None = None
    ring_step: int | None = None
    where: str | None = None
    """Outside a unit: the stage (``gradient sync``, ``plan agreement``)."""
    collective: str | None = None
    """The collective call waiting (``barrier``, ``all_gather_object``), when one is named."""


_POSITION: list[Position] = [Position()]


def position() -> Position:
    return _POSITION[-1]


@contextmanager
def at(**fields) -> Iterator[Position]:
    """Inside the block, the position has ``fields`` (step=, unit=, ring_step=, where=,
    collective=). A
    communication failure inside (a collective's timeout, a peer gone) leaves as one
    :class:`CommTimeout` line naming where this rank waited; the original is its cause."""
    _POSITION.append(replace(_POSITION[-1], **fields))
    try:
        yield _POSITION[-1]
    except RuntimeError as err:
        if isinstance(err, CommTimeout) or not is_comm_failure(err):
            raise
        line = f"{waiting_line(_rank(), _POSITION[-1])}: {failure(err, peer=_peers())}"
        raise CommTimeout(line) from err
    finally:
        _POSITION.pop()


_TIMEOUT_S: list[float | None] = [None]


def set_comm_timeout(seconds: float | None) -> None:
    """The process group's timeout (``--comm-timeout``), for lines whose backend text lacks it
    (:class:`~sparsebalance.engine.runtime.Runtime` sets it when it starts the group)."""
    _TIMEOUT_S[0] = seconds


def failure(err: BaseException, timeout_s: float | None = None, peer: int | str | None = None) -> str:
    """What a communication error means, in a few words, without the backend's source paths:
    ``no message from rank 1 within 5 s (--comm-timeout): it is stalled or has died`` for a
    timeout, ``rank 1 closed its connection: it has stopped or died`` for a peer gone;
    anything else is the backend's text, cleaned. ``peer``: the rank waited for, or a phrase
    (``one of the other 3 ranks``); ``timeout_s``: when the text lacks it."""
    text = " ".join(str(err).split())
    who = "a peer" if peer is None else peer if isinstance(peer, str) else f"rank {peer}"
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        # gloo: "Timed out waiting 5000ms for recv"; NCCL's watchdog: "Timeout(ms)=5000"
        found = re.search(r"waiting (\d+) ?ms", text) or re.search(r"Timeout\(ms\)=(\d+)", text)
        seconds = int(found.group(1)) / 1000 if found else timeout_s or _TIMEOUT_S[0]
        within = f"within {seconds:g} s (--comm-timeout)" if seconds else "within --comm-timeout"
        return f"no message from {who} {within}: it is stalled or has died"
    if any(s in lowered for s in ("connection closed", "connection reset", "broken pipe")):
        return f"{who} closed its connection: it has stopped or died"
    return re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)[:200]


def _peers() -> str | None:
    """Who a collective of the whole world waits for, seen from this rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world, me = dist.get_world_size(), dist.get_rank()
    others = [r for r in range(world) if r != me]
    if len(others) == 1:
        return f"rank {others[0]}"
    return f"one of the other {len(others)} ranks"


def is_comm_failure(err: BaseException) -> bool:
    """A torch.distributed error (timeout, closed connection), not a bug elsewhere."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):  # torch >= 2.6 (pyproject): always there
        return True
    text = str(err).lower()
    # "pair closure": gloo's error for every call on a pair after one of its waits timed out
    signs = ("gloo", "nccl", "timed out", "connection closed", "pair closure")
    return any(s in text for s in signs)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def set_ring_step(step: int) -> None:
    """The ring's current step (called by the ring loops, cheap: no allocation per layer)."""
    _POSITION[-1] = replace(_POSITION[-1], ring_step=step)


def waiting_line(rank: int, pos: Position | None = None) -> str:
    """``rank N waiting in unit U, ring step S, step T`` (parts that are unknown are left out)."""
    pos = pos or position()
    if pos.unit is not None:
        where = f"unit {pos.unit}" + ("" if pos.ring_step is None else f", ring step {pos.ring_step}")
    elif pos.where is not None:
        where = pos.where + ("" if pos.collective is None else f" ({pos.collective})")
    else:
        where = pos.collective or "a collective"
    step = "" if pos.step is None else f", step {pos.step}"
    return f"rank {rank} waiting in {where}{step}"


class DeviceWaits:
    """CUDA: the ring waits issued so far (position, event after the wait, host time issued), and
    the watchdog that turns the first one stuck for ``timeout_s`` into one line."""

    def __init__(self, rank: int, timeout_s: float, on_hang: Callable[[str], None] | None = None):
        self.rank, self.timeout_s = rank, timeout_s
        self.pending: list[tuple[Position, Any, float]] = []
        self._lock = threading.Lock()
        self._on_hang = on_hang or _exit_with_line
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self, event: Any, pos: Position | None = None) -> None:
        """A wait was issued; ``event`` (recorded after it on the compute stream) completes when
        the transfer has."""
        with self._lock:
            self.pending.append((pos or position(), event, time.monotonic()))

    def stuck(self, now: float | None = None) -> str | None:
        """The line of the first wait not complete ``timeout_s`` after it was issued, or None;
        completed waits are dropped."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self.pending and self.pending[0][1].query():
                self.pending.pop(0)
            if self.pending and now - self.pending[0][2] > self.timeout_s:
                pos = self.pending[0][0]
                return (
                    f"{waiting_line(self.rank, pos)}: the ring transfer has not completed "
                    f"within {self.timeout_s:g} s (--comm-timeout)"
                )
        return None

    def start(self, every_s: float | None = None) -> None:
        """Check every ``every_s`` seconds (default: a tenth of the timeout, 1-10 s) in a daemon
        thread."""
        every = every_s or min(10.0, max(1.0, self.timeout_s / 10))

        def loop() -> None:
            while not self._stop.wait(every):
                line = self.stuck()
                if line is not None:
                    self._on_hang(line)
                    return

        self._thread = threading.Thread(target=loop, name="sparsebalance-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def _exit_with_line(line: str) -> None:
    """The main thread is blocked inside CUDA: say where, then end the process (exit code 124,
    as ``timeout`` does) so the launcher stops the other ranks."""
    print(f"sparsebalance: {line}", file=sys.stderr, flush=True)
    os._exit(124)
