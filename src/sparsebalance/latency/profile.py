"""``Profile``: measured cost tables of one model on one machine, with a fingerprint, as JSON.

Tables (all forward + backward seconds):
- ``attention``: one layer's attention for one document, by length x density, including the block
  selection (``estimate_block_mass`` + the budget rule), with the backend training uses;
- ``layer_other``: one decoder layer without attention (norms, projections, rotary, MLP), by
  token count of the micro-batch;
- ``head``: embedding + final norm + LM head + loss, by token count;
- ``attention_call_seconds``: the part of every attention entry paid once per call (per layer
  and micro-batch), not per document;
- ``optimizer_seconds`` and ``allreduce_seconds``: once per step, reported separately.

A measured profile (schema 2) holds tables *evaluated from a fitted physical form* (see
:mod:`sparsebalance.latency.form`); ``fit`` keeps the form's coefficients and the design it was
fitted on, ``noise`` the timing noise seen while measuring. Schema-1 files (interpolated grids)
still load; the trainer's profile cache only reuses schema-2 entries.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..files import write_text_atomic
from ..models import ModelShapes
from ..results import machine_info
from ..versions import PROFILE

SCHEMA_PREFIX = "sparsebalance.profile/"
SCHEMA = f"{SCHEMA_PREFIX}{PROFILE.version}"
READABLE_SCHEMAS = tuple(f"{SCHEMA_PREFIX}{v}" for v in sorted({*PROFILE.readable, PROFILE.version}))


class ProfileMismatchWarning(UserWarning):
    """The profile was measured on another setup than the one running."""


def fingerprint(
    shapes: ModelShapes,
    device: torch.device,
    dtype: str,
    backend: str,
    block_size: int,
    threads: int | None = None,
    layout: str = "threshold",
) -> dict:
    """What a profile's numbers depend on. ``threads``: the CPU threads per process the timings
    hold for (default: this process's ``torch.get_num_threads()``; None on GPU) -- a profile
    measured with 2 threads mispredicts ranks that run with 1. ``layout``: the shape of the
    layouts it timed, ``threshold`` (gamma budgets) or ``top-k`` (a ``layout`` key is written for
    top-k only, so earlier profiles keep their fingerprints)."""
    if layout not in ("threshold", "top-k"):
        raise ValueError(f"layout must be 'threshold' or 'top-k', got {layout!r}")
    info = machine_info(device)
    if device.type == "cpu":
        threads = int(threads or info["cpu_threads"])
    return {
        "device": info.get("gpu", info["cpu"]),
        "device_type": device.type,
        "threads": threads if device.type == "cpu" else None,
        "torch": torch.__version__.split("+")[0],
        "dtype": dtype,
        "backend": backend,
        "block_size": block_size,
        "shapes": {k: v for k, v in shapes.to_dict().items() if k != "name"},
        **({"layout": layout} if layout == "top-k" else {}),
    }


@dataclass
class Table1D:
    tokens: list[int]
    seconds: list[float]

    def validate(self, name: str) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds):
            raise ValueError(f"profile: {name} needs >= 2 points with one time each")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError(f"profile: {name}.tokens must be strictly increasing")
        if not all(np.isfinite(self.seconds)) or min(self.seconds) < 0:
            raise ValueError(f"profile: {name}.seconds must be finite and >= 0")


@dataclass
class AttentionTable:
    lengths: list[int]
    densities: list[float]
    seconds: list[list[float]]  # [length][density]

    def validate(self) -> None:
        arr = np.asarray(self.seconds, dtype=float)
        if arr.shape != (len(self.lengths), len(self.densities)) or min(arr.shape) < 2:
            raise ValueError("profile: attention.seconds must be (lengths x densities), each >= 2")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:], strict=False)):
            raise ValueError("profile: attention.lengths must be strictly increasing")
        if any(b <= a for a, b in zip(self.densities, self.densities[1:], strict=False)):
            raise ValueError("profile: attention.densities must be strictly increasing")
        if not (self.densities[0] > 0 and self.densities[-1] <= 1):
            raise ValueError("profile: attention.densities must lie in (0, 1]")
        if not np.isfinite(arr).all() or arr.min() < 0:
            raise ValueError("profile: attention.seconds must be finite and >= 0")


@dataclass
class Profile:
    fingerprint: dict
    attention: AttentionTable
    layer_other: Table1D
    head: Table1D
    num_layers: int
    optimizer_seconds: float = 0.0
    allreduce_seconds: float | None = None
    attention_call_seconds: float = 0.0
    """Fixed cost of one attention call (selection + kernel setup), paid once per layer and
    micro-batch however many documents it packs; included in every ``attention`` entry."""
    scales: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    """End-to-end calibration of the (attention, rest of layer, head) tables, fitted when the
    profile is measured: parts timed alone cost more than inside a fused step."""
    meta: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)
    """The fitted form (``features``, ``coefficients``, leave-one-out errors, the timed design);
    empty for analytic and schema-1 profiles."""
    noise: dict = field(default_factory=dict)
    """Timing noise while measuring: coefficient of variation of repeats (median, p90), rounds,
    outliers rejected, machine load."""
    dense_from: float | None = None
    """The crossover: the density from which one document's attention is faster on the dense
    kernel (FlashAttention varlen) than on the sparse one, measured on CUDA for top-k profiles
    (:mod:`.crossover`). Documents from it run whole and dense; the attention table is flat from
    it (what they cost). None: not measured (CPU, analytic, gamma): only documents a budget
    covers run dense."""

    def __post_init__(self) -> None:
        for name in ("fingerprint", "meta", "fit", "noise"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"profile: {name} must be an object, got {getattr(self, name)!r}")
        for name in ("optimizer_seconds", "allreduce_seconds"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and np.isfinite(value) and value >= 0):
                raise ValueError(f"profile: {name} must be finite and >= 0, got {value!r}")
        if len(self.scales) != 3 or not all(0 < x < 100 for x in self.scales):
            raise ValueError(f"profile: scales must be 3 positive factors, got {self.scales}")
        if self.num_layers <= 0:
            raise ValueError(f"profile: num_layers must be > 0, got {self.num_layers}")
        self.attention.validate()
        self.layer_other.validate("layer_other")
        self.head.validate("head")
        c = self.dense_from
        if c is not None and not (_is_number(c) and 0.0 < c <= 1.0):
            raise ValueError(f"profile: dense_from must be in (0, 1] or null, got {c!r}")
        if not 0.0 <= self.attention_call_seconds <= min(map(min, self.attention.seconds)):
            raise ValueError("profile: attention_call_seconds must be in [0, min attention time]")

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict, where: str = "profile") -> Profile:
        """A profile from its JSON; ``ValueError`` naming ``where`` when it is not a profile, or
        one of a schema version this build does not read (:data:`~sparsebalance.versions.PROFILE`,
        the line says what to do)."""
        found = data.get("schema") if isinstance(data, dict) else None
        if not (isinstance(found, str) and found.startswith(SCHEMA_PREFIX)):
            found = found if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where}: not a SparseBalance profile (schema {found!r}, expected {SCHEMA!r})")
        version = found[len(SCHEMA_PREFIX) :]
        PROFILE.check(int(version) if version.isdigit() else version, where)
        try:
            if not _is_number(data["num_layers"]) or int(data["num_layers"]) != data["num_layers"]:
                raise ValueError(f"profile: num_layers must be an integer, got {data['num_layers']!r}")
            return cls(
                fingerprint=data["fingerprint"],
                attention=AttentionTable(**data["attention"]),
                layer_other=Table1D(**data["layer_other"]),
                head=Table1D(**data["head"]),
                num_layers=int(data["num_layers"]),
                optimizer_seconds=float(data.get("optimizer_seconds", 0.0)),
                allreduce_seconds=data.get("allreduce_seconds"),
                attention_call_seconds=float(data.get("attention_call_seconds", 0.0)),
                scales=[float(x) for x in data.get("scales", [1.0, 1.0, 1.0])],
                meta=data.get("meta", {}),
                fit=data.get("fit", {}),
                noise=data.get("noise", {}),
                dense_from=data.get("dense_from"),
            )
        except (KeyError, TypeError) as err:  # a missing key, a table of the wrong shape
            raise ValueError(f"{where}: damaged: a field is missing or malformed ({err})") from None
        except ValueError as err:  # a value out of its range (NaN or negative seconds, ...)
            raise ValueError(f"{where}: damaged: {str(err).removeprefix('profile: ')}") from None

    def save(self, path: str | Path) -> None:
        """Atomic write: a crash never leaves a half-written profile."""
        # concurrent writers (ranks, runs sharing the cache) each write a temporary of their own
        write_text_atomic(path, json.dumps(self.to_json(), indent=1) + "\n")

    def check_fingerprint(self, running: dict, strict: bool = False, where: str = "latency profile") -> list[str]:
        """Compare with the running setup: warn (or raise with ``strict``) in one line naming
        the fields that differ; returns them (``"threads 2 vs 1"``).

        Not compared: :data:`BOOKKEEPING` (the cache's ``max_len`` and ``schema``). An analytic
        profile (FLOP counts of a named accelerator) differs from every machine it runs on by
        design (device, dtype, backend, threads, layout): what it must match, the model shapes
        and the block size, :func:`check_profile_fits` refuses; the rest is returned but not
        warned about (``strict`` still raises). ``where``: how the line names the profile."""
        keys = sorted((set(self.fingerprint) | set(running)) - set(BOOKKEEPING))
        diffs = [
            _difference(key, self.fingerprint.get(key), running.get(key))
            for key in keys
            if self.fingerprint.get(key) != running.get(key)
        ]
        if not diffs:
            return diffs
        msg = f"{where} was measured on another setup: {', '.join(diffs)} (profile vs this run)"
        if strict:
            raise ValueError(msg + "; re-run `sparsebalance profile` or drop --strict")
        if self.fingerprint.get("analytic") is not True:
            warnings.warn(
                msg + "; predictions start from it and online recalibration adapts them",
                ProfileMismatchWarning,
                stacklevel=user_stacklevel(),
            )
        return diffs


BOOKKEEPING = ("max_len", "schema")
"""Fingerprint fields of the trainer's cache that are no part of the setup: ``max_len`` (the
longest micro-batch the profile was measured for; longer ones are priced by its fitted form) and
the file's schema (checked when it is read)."""


def _difference(key: str, theirs, mine) -> str:
    """``threads 2 vs 1``; the field's name alone where a value would not fit a short line (a
    CPU's name, the model shapes)."""
    if all(
        v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 16) for v in (theirs, mine)
    ):
        return f"{key} {_short(theirs)} vs {_short(mine)}"
    return key


def _short(value) -> str:
    return "none" if value is None else str(value)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function calling this one that names
    the first frame outside the sparsebalance package: the user's line that led to the warning
    (``sparsebalance.hf.enable(...)``), not a line of the library (2, the caller's caller, when
    every frame is the package's)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


COST_SHAPES = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "qkv_bias",
)
"""The model shapes a profile's tables depend on (the context length does not: a profile covers
the lengths it was measured at, priced beyond by its fitted form)."""


def check_profile_fits(profile: Profile, shapes: ModelShapes, block_size: int, device_type: str, where: str) -> None:
    """Refuse, in one ``ValueError`` naming ``where`` (``--profile p.json``), a profile that
    prices another run: other model shapes (its per-layer tables would be read for layers this
    model has not, or miss some), another block size (its densities count other blocks) or a
    measured profile of another device kind (CPU seconds for a GPU run). An analytic profile
    (FLOP counts of a named accelerator, no ``device_type``) is accepted on any device: its
    relative costs hold and online recalibration scales them. The rest of the fingerprint
    (threads, torch version, dtype, backend) only warns (:meth:`Profile.check_fingerprint`)."""
    fp = profile.fingerprint
    diffs = shape_differences(profile, shapes)
    if fp.get("block_size") is not None and fp["block_size"] != block_size:
        diffs.append(f"block_size {fp['block_size']!r} vs {block_size}")
    if fp.get("device_type") is not None and fp["device_type"] != device_type:
        diffs.append(f"device {fp['device_type']!r} vs {device_type!r}")
    if diffs:
        raise ValueError(
            f"{where} was made for another run (profile vs this run: {'; '.join(diffs)}): make "
            f"one for this run with `sparsebalance profile --model MODEL --block-size "
            f"{block_size} --device {device_type}`"
        )


def shape_differences(profile: Profile, shapes: ModelShapes) -> list[str]:
    """``"num_layers 24 vs 4"`` for each cost-relevant shape (:data:`COST_SHAPES`) in which the
    model ``profile`` was made for differs from ``shapes`` (the layer count alone for a profile
    whose fingerprint keeps no shapes)."""
    theirs = profile.fingerprint.get("shapes")
    theirs = theirs if isinstance(theirs, dict) else {}
    mine = shapes.to_dict()
    diffs = [f"{k} {theirs[k]!r} vs {mine[k]!r}" for k in COST_SHAPES if k in theirs and theirs[k] != mine[k]]
    if "num_layers" not in theirs and profile.num_layers != shapes.num_layers:
        diffs.append(f"num_layers {profile.num_layers} vs {shapes.num_layers}")
    return diffs


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile JSON file (clear ``ValueError`` when missing or corrupt)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"profile {str(path)!r} does not exist (make one with `sparsebalance profile`)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"profile {str(path)!r} is not valid JSON: {err}") from None
    return Profile.from_json(data, f"profile {str(path)!r}")
