"""Bytes of this process and of the ``--memory-budget`` flag: the resident size now and at its
peak (what ``--capacity auto`` takes as the base, and what memory probes measure), and byte
counts written with units."""

from __future__ import annotations

import math
from pathlib import Path


def _status_bytes(field: str) -> int:
    """``field`` of Linux's ``/proc/self/status`` in bytes (0 where unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def current_rss_bytes() -> int:
    """Resident bytes of this process now (Linux ``VmRSS``; 0 where unavailable)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> tuple[int, str]:
    """``(bytes, source)``: this process's peak resident size since it started its program.

    Linux ``VmHWM`` (the high-water mark of this program's own memory). Not ``ru_maxrss``: Linux
    carries the parent's peak across ``fork`` + ``exec`` into it, so a probe started by a
    ``sparsebalance profile`` process holding torch reported that process's ~0.7 GB instead of
    its own peak. Elsewhere ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    hwm = _status_bytes("VmHWM")
    if hwm:
        return hwm, "VmHWM"
    import resource
    import sys

    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, "ru_maxrss"


def parse_bytes(text: str) -> float:
    """``"80GB"``, ``"72GiB"``, ``"512MiB"``, ``"1e9"`` -> bytes (for ``--memory-budget``)."""
    units = {
        "": 1,
        "b": 1,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    raw = text.strip().lower().replace(" ", "")
    num = raw.rstrip("kmgtib")
    unit = raw[len(num) :]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(
            f"--memory-budget {text!r}: expected a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        ) from None
    if not (math.isfinite(value) and value > 0):  # nan, inf
        raise ValueError(f"--memory-budget must be a finite number of bytes > 0, got {text!r}")
    return value
