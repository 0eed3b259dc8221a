"""Measured memory coefficients: fit the memory model to probe peaks, store and find the result.

``sparsebalance profile --memory`` runs a few probes (:mod:`sparsebalance.train.memory_probe`: one
fresh process per token count, peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA) and
:func:`fit_memory` fits two coefficients of :class:`~.memory.MemoryModel` to them:

- ``act_bytes``: bytes per saved activation element, which scales every token-proportional term
  (kept activations, reruns, the backward's transients); analytic: 4 (fp32 CPU), 2.5 (bf16);
- ``overhead_bytes``: a constant beyond the measured ``base`` (allocator slack, autograd's graph,
  library workspaces), negative when the analytic state is an overcount.

The fit: for every ``act_bytes`` on a log grid (then refined), the overhead is the mean of
``peak - base - model(tokens)`` (least squares in bytes), and the pair with the smallest squared
error wins. The model's peak is a maximum of linear terms in ``act_bytes``, so it is convex and
piecewise linear in it; a grid plus a golden-section refinement finds the minimum without
assuming one piece. Two probes determine both coefficients; a third checks them (its error is
reported with the others, :attr:`MemoryCalibration.errors`).

Stored as :class:`MemoryCalibration` JSON (``schema`` :data:`SCHEMA`) in the latency profile's
``meta["memory"]`` and in ``~/.cache/sparsebalance/memory/``; a calibration is used only where its
fingerprint (device, dtype, backend, block size, model shapes, torch version and the schema)
equals the running one, so older or foreign entries are ignored, never misread.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ..files import write_text_atomic
from ..models import ModelShapes
from .memory import MemoryCoefficients, MemoryConfig, MemoryModel

SCHEMA = "sparsebalance.memory-calibration/1"
CACHE_DIR = Path.home() / ".cache" / "sparsebalance" / "memory"
ACT_BYTES_RANGE = (0.25, 64.0)
"""Bytes per saved element the fit may return (a result at an end means the probes disagree
with the model's form: the calibration says so in ``at_range_end``)."""


@dataclass(frozen=True)
class MemoryProbe:
    """One measured micro-batch (what :mod:`sparsebalance.train.memory_probe` prints)."""

    tokens: int
    """Tokens of the micro-batch (one document)."""
    checkpointing: str
    """Activation checkpointing mode it ran with."""
    loss: str
    """``chunked`` or ``plain``."""
    base_bytes: float
    """Resident bytes before the model (CPU); 0 on CUDA."""
    peak_bytes: float
    """Peak bytes of the micro-batch (CPU: peak RSS; CUDA: max allocated)."""
    static_bytes: float = 0.0
    """Bytes after the warm-up step (model + optimizer state), for the report."""
    seconds: float = 0.0
    """Wall time of the measured forward + backward."""
    source: str = ""
    """``VmHWM`` (``ru_maxrss`` off Linux) or ``torch.cuda.max_memory_allocated``."""

    def config(self, block_size: int) -> MemoryConfig:
        return MemoryConfig(self.checkpointing, self.loss, block_size=block_size)


@dataclass(frozen=True)
class MemoryCalibration:
    """Measured ``act_bytes`` and ``overhead_bytes`` for one fingerprint, with the evidence."""

    fingerprint: dict
    """What the numbers depend on (see :func:`memory_fingerprint`)."""
    act_bytes: float
    """Fitted bytes per saved activation element."""
    overhead_bytes: float
    """Fitted constant bytes beyond the measured base."""
    probes: tuple[MemoryProbe, ...]
    """The measurements the fit used."""
    errors: tuple[float, ...]
    """Per probe: (calibrated prediction - measured) / measured peak."""
    analytic_errors: tuple[float, ...]
    """Per probe, the same with the analytic coefficients (what the calibration changed)."""
    at_range_end: bool = False
    """The fitted ``act_bytes`` sits at an end of :data:`ACT_BYTES_RANGE` (suspect probes)."""

    def coefficients(self, analytic: MemoryCoefficients) -> MemoryCoefficients:
        """``analytic`` with the measured ``act_bytes``, and the overhead added to its base
        (``analytic.base_bytes`` is the running process's base on CPU, 0 on CUDA)."""
        name = analytic.name.replace(" (analytic)", "")
        return replace(
            analytic,
            name=f"{name} (measured: profile --memory)",
            act_bytes=self.act_bytes,
            base_bytes=analytic.base_bytes + self.overhead_bytes,
        )

    @property
    def max_error(self) -> float:
        return max(abs(e) for e in self.errors)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> MemoryCalibration:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a memory calibration of schema {SCHEMA!r} (found {found!r})")
        try:
            return cls(
                fingerprint=dict(data["fingerprint"]),
                act_bytes=float(data["act_bytes"]),
                overhead_bytes=float(data["overhead_bytes"]),
                probes=tuple(MemoryProbe(**p) for p in data["probes"]),
                errors=tuple(float(e) for e in data["errors"]),
                analytic_errors=tuple(float(e) for e in data["analytic_errors"]),
                at_range_end=bool(data.get("at_range_end", False)),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"memory calibration: missing or malformed field {err}") from None


def memory_fingerprint(profile_fingerprint: dict, tied: bool) -> dict:
    """The latency profile's fingerprint (:func:`sparsebalance.latency.fingerprint`) without what
    memory does not depend on (threads, the profile's length and schema), plus the tied
    embedding and :data:`SCHEMA`."""
    drop = ("threads", "max_len", "schema")
    fp = {k: v for k, v in profile_fingerprint.items() if k not in drop}
    return {**fp, "tied_embeddings": bool(tied), "schema": SCHEMA}


def _predict(shapes, analytic, tied, probes, block_size, act_bytes) -> np.ndarray:
    """``(P,)`` model peaks without any base, at ``act_bytes``."""
    model = MemoryModel(shapes, replace(analytic, act_bytes=act_bytes, base_bytes=0.0), tied)
    return np.array([model.peak_bytes(p.tokens, p.config(block_size)) for p in probes])


def fit_memory(
    shapes: ModelShapes,
    analytic: MemoryCoefficients,
    probes: Sequence[MemoryProbe],
    fingerprint: dict,
    block_size: int,
    tied: bool = True,
) -> MemoryCalibration:
    """Fit ``act_bytes`` and ``overhead_bytes`` to ``probes`` (at least 2 distinct token counts;
    see the module docstring). ``analytic``: the coefficients the fit starts from (its other
    fields stay), with ``base_bytes`` ignored (each probe has its own measured base)."""
    if len({p.tokens for p in probes}) < 2:
        raise ValueError("memory calibration needs probes at >= 2 different token counts")
    y = np.array([p.peak_bytes - p.base_bytes for p in probes], dtype=np.float64)

    def sse(a: float) -> tuple[float, float]:
        m = _predict(shapes, analytic, tied, probes, block_size, a)
        off = float(np.mean(y - m))
        return float(np.sum((y - m - off) ** 2)), off

    lo, hi = ACT_BYTES_RANGE
    grid = np.geomspace(lo, hi, 121)
    scores = [sse(float(a))[0] for a in grid]
    j = int(np.argmin(scores))
    a_lo, a_hi = float(grid[max(j - 1, 0)]), float(grid[min(j + 1, grid.size - 1)])
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(60):  # golden section on the bracket around the best grid point
        c = a_hi - golden * (a_hi - a_lo)
        d = a_lo + golden * (a_hi - a_lo)
        if sse(c)[0] <= sse(d)[0]:
            a_hi = d
        else:
            a_lo = c
    act = (a_lo + a_hi) / 2
    if sse(float(grid[j]))[0] < sse(act)[0]:
        act = float(grid[j])
    off = sse(act)[1]
    peaks = np.array([p.peak_bytes for p in probes])
    bases = np.array([p.base_bytes for p in probes])
    fitted = _predict(shapes, analytic, tied, probes, block_size, act) + bases + off
    plain = _predict(shapes, analytic, tied, probes, block_size, analytic.act_bytes) + bases
    return MemoryCalibration(
        fingerprint=dict(fingerprint),
        act_bytes=act,
        overhead_bytes=off,
        probes=tuple(probes),
        errors=tuple(((fitted - peaks) / peaks).tolist()),
        analytic_errors=tuple(((plain - peaks) / peaks).tolist()),
        at_range_end=bool(act <= lo * 1.01 or act >= hi * 0.99),
    )


def cache_path(fingerprint: dict, cache_dir: Path | None = None) -> Path:
    """Where the calibration of ``fingerprint`` is cached (the key hashes the whole of it)."""
    key = hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
    name = str(fingerprint.get("shapes", {}).get("num_layers", "model"))
    return Path(cache_dir or CACHE_DIR) / f"layers{name}-{key}.json"


def save_calibration(cal: MemoryCalibration, cache_dir: Path | None = None) -> Path:
    """Write ``cal`` to the cache (atomic); returns the path."""
    # concurrent writers (ranks, runs sharing the cache) each write a temporary of their own
    return write_text_atomic(cache_path(cal.fingerprint, cache_dir), json.dumps(cal.to_json(), indent=1) + "\n")


def find_calibration(
    running: dict,
    profile_meta: dict | None = None,
    cache_dir: Path | None = None,
    checkpointing: str | None = None,
) -> tuple[MemoryCalibration | None, str]:
    """The calibration for the ``running`` fingerprint (:func:`memory_fingerprint`): from a
    latency profile's ``meta["memory"]`` first, else the cache. With ``checkpointing``, only one
    whose probes ran in that mode (a fit in one mode is not evidence for another: on the tiny
    model it was not, ``benchmarks/results/2026-11-23-memory-calibration-cpu.md``). Returns it
    (None when there is none that matches) and one line saying where it came from or why none
    was used."""
    notes = []
    candidates = []
    if profile_meta and "memory" in profile_meta:
        candidates.append(("the --profile", profile_meta["memory"]))
    path = cache_path(running, cache_dir)
    if path.is_file():
        try:
            candidates.append((str(path), json.loads(path.read_text())))
        except (OSError, ValueError):
            notes.append(f"{path} unreadable")
    for where, data in candidates:
        try:
            cal = MemoryCalibration.from_json(data)
        except ValueError as err:
            notes.append(f"{where}: {err}")
            continue
        if cal.fingerprint != running:
            notes.append(f"{where}: measured on another setup")
            continue
        modes = {p.checkpointing for p in cal.probes}
        if checkpointing is not None and checkpointing not in modes:
            notes.append(f"{where}: measured with --activation-checkpointing {'/'.join(modes)}")
            continue
        return cal, f"measured coefficients from {where}"
    why = "; ".join(notes) or "none measured for this setup"
    return None, f"analytic coefficients ({why}; `sparsebalance profile --memory` measures them)"


__all__ = [
    "ACT_BYTES_RANGE",
    "CACHE_DIR",
    "SCHEMA",
    "MemoryCalibration",
    "MemoryProbe",
    "cache_path",
    "find_calibration",
    "fit_memory",
    "memory_fingerprint",
    "save_calibration",
]
