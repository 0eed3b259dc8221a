"""Wall-clock timing done properly: warm-up runs, the median of repeats, device synchronisation
(CUDA events on GPU). Used by every benchmark and by the latency profiler."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes on ``device``."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], device: torch.device, warmup: int = 1, repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls after ``warmup`` untimed calls."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    return statistics.median(time_once(fn, device) for _ in range(repeats))


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[int]:
    """Run the block with ``torch.set_num_threads(num_threads)`` (None: leave it), restoring the
    previous count after; yields the count in force. CPU timings depend on it: a profile must be
    measured with the threads the timed work will run with."""
    before = torch.get_num_threads()
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"threads must be >= 1, got {num_threads}")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
