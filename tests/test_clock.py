"""Issue 26, item 3: device-true time through one clock, tested on CPU with fake CUDA events.

The fake device has its own timeline (each recorded event advances it by :data:`TICK`) and an
event can be read only once a synchronize has completed it, as ``Event.elapsed_time`` on CUDA.
So these tests fail if a time is taken from the host (``perf_counter``) instead of the device,
or read before the step's synchronize (a host sync in the middle of the step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparsebalance.clock import Clock, use_clock
from sparsebalance.engine.parallelize import ReadyClock
from sparsebalance.engine.step import StepRunner
from sparsebalance.parallel.p2p import RING_WAITS, _Pending

TICK = 0.25  # device seconds between two consecutive events


class FakeDevice:
    def __init__(self) -> None:
        self.now, self.syncs = 0.0, 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def synchronize(self) -> None:
        self.syncs += 1


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.t, self.epoch = device, None, None

    def record(self) -> None:
        self.t, self.epoch = self.device.now, self.device.syncs
        self.device.now += TICK

    def query(self) -> bool:
        return self.device.syncs > self.epoch

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("event not complete: read before the step's synchronize")
        return (end.t - self.t) * 1e3


def fake_clock() -> tuple[Clock, FakeDevice]:
    dev = FakeDevice()
    return Clock("cpu", event_factory=dev.event, synchronize=dev.synchronize), dev


def test_cpu_clock_is_perf_counter_and_event_clock_reads_device_time():
    cpu = Clock("cpu")
    a, b = cpu.mark(), cpu.mark()
    assert a.event is None and cpu.seconds(a, b) == b.host - a.host >= 0
    clock, _dev = fake_clock()
    a, b = clock.mark(), clock.mark()
    with pytest.raises(RuntimeError, match="not complete"):
        clock.seconds(a, b)
    clock.synchronize()
    assert clock.seconds(a, b) == pytest.approx(TICK)  # device time, not the ~us between stamps


def test_comm_hook_marks_on_the_device_not_at_enqueue(monkeypatch):
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as hooks

    monkeypatch.setattr(hooks, "allreduce_hook", lambda state, bucket: "future")
    clock, dev = fake_clock()
    state = ReadyClock(clock)
    start = clock.mark()
    assert ReadyClock.hook(state, bucket=None) == "future"
    dev.now += 3.0  # the backward's kernels run after the host handed the bucket over
    clock.synchronize()
    assert state.last.event is not None and clock.seconds(start, state.last) == pytest.approx(TICK)


def test_ring_wait_is_the_compute_streams_stall_not_the_hosts():
    """NCCL's ``Work.wait()`` returns at once (the stream waits): host time ~0, device 2 s."""
    clock, dev = fake_clock()

    class NcclLikeWork:
        def wait(self, timeout=None):
            dev.now += 2.0  # the compute stream stands still until the transfer lands

    with use_clock(clock):
        n0 = len(RING_WAITS)
        _Pending(torch.zeros(1), [NcclLikeWork()]).wait()
        clock.synchronize()
        assert RING_WAITS.seconds(n0) == pytest.approx(TICK + 2.0)
        RING_WAITS.fold()


def test_exact_mode_times_the_all_reduce_on_the_device():
    clock, dev = fake_clock()
    rec = SimpleNamespace(bubble_s=0.0, sync_s=0.0, compute_s=1.0)
    runner = SimpleNamespace(
        emulated=False,
        par=SimpleNamespace(exact=True, clock=clock, sync_gradients=lambda params: setattr(dev, "now", dev.now + 1.5)),
        rt=SimpleNamespace(barrier=lambda: None, all_gather_object=lambda r: [r]),
        updater=SimpleNamespace(params=[]),
    )
    StepRunner.synchronize(runner, SimpleNamespace(records=[rec]))
    assert dev.syncs == 1
    assert rec.bubble_s == pytest.approx(TICK) and rec.sync_s == pytest.approx(TICK + 1.5)
