"""Device-true time: the one clock behind every time that feeds DST, the bubble and the latency
model (the executor's micro-batch times, the DDP comm hook's "gradients ready", the ring's
waits, ``--measure-bubble exact``'s sync).

On CPU the host executes the work, so a :class:`Mark` is a ``time.perf_counter()`` stamp. On
CUDA the host only *enqueues*: a host stamp taken when a kernel or an all-reduce is launched says
nothing about when the device runs it (a comm hook stamping ``perf_counter`` marks when the
bucket was enqueued, long before its gradients exist; a ``Work.wait()`` on NCCL returns at once,
having only made the current stream wait). A CUDA mark is therefore an event recorded on the
compute stream (the current stream: forward, backward and the hooks the autograd engine runs for
it), complete when the device has run everything enqueued before it. The seconds between two
marks are read with ``Event.elapsed_time`` once both are complete: after the step's one
``synchronize``, never inside a layer (a read before that would block the host).

Tests drive the event path on CPU with ``Clock(event_factory=..., synchronize=...)``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Mark:
    """A point in a device's timeline: the host stamp, and the device event where there is one."""

    host: float
    """``time.perf_counter()`` when the mark was taken (on CUDA: when it was enqueued)."""
    event: Any = None
    """The CUDA event recorded on the compute stream (None on CPU)."""


class Clock:
    """Marks on one device and the seconds between them (see the module docstring)."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        event_factory: Callable[[], Any] | None = None,
        synchronize: Callable[[], None] | None = None,
    ):
        self.device = torch.device(device)
        self.events = self.device.type == "cuda" or event_factory is not None
        """Marks are device events (CUDA, or a test's fake events)."""
        self._new_event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._synchronize = synchronize or (lambda: torch.cuda.synchronize(self.device))

    def mark(self) -> Mark:
        """Now, on the device: the host stamp, plus an event on the current (compute) stream."""
        host = time.perf_counter()
        if not self.events:
            return Mark(host)
        event = self._new_event()
        event.record()
        return Mark(host, event)

    def synchronize(self) -> None:
        """Wait for the device (CUDA: ``torch.cuda.synchronize``); a no-op on CPU. Call it once,
        at the step's end, before reading :meth:`seconds` of event marks."""
        if self.events:
            self._synchronize()

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end``: device time between the events where both have one
        (they must be complete: after :meth:`synchronize`), else host time."""
        if start.event is None or end.event is None:
            return end.host - start.host
        return float(start.event.elapsed_time(end.event)) / 1e3


_CURRENT: list[Clock] = [Clock("cpu")]


def current_clock() -> Clock:
    """The clock of the code running now (the executor installs its device's with
    :func:`use_clock`); a CPU clock otherwise."""
    return _CURRENT[-1]


@contextlib.contextmanager
def use_clock(clock: Clock) -> Iterator[Clock]:
    """Make ``clock`` the :func:`current_clock` inside the block (the ring's waits use it)."""
    _CURRENT.append(clock)
    try:
        yield clock
    finally:
        _CURRENT.pop()
