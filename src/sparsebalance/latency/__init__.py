"""Latency model: profile the hardware, predict micro-batch times, recalibrate online.

```python
model = LatencyModel(load_profile("profile.json"))       # or default_latency_model(shapes, device, block_size=64)
model.predict([4096, 1000], [0.2, 0.6])                  # seconds, fwd+bwd of one micro-batch
model.update([4096, 1000], [0.2, 0.6], measured_seconds)  # online recalibration
```
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from ..files import CACHE_ENV, cache_folder, unwritable
from ..models import ModelShapes, load_shapes
from ..ops.flex_config import resolve_block_size
from .analytic import ACCELERATORS, allreduce_seconds, analytic_profile
from .context import ContextCost, Links, analytic_links, context_cost, links_from_profile
from .model import LatencyModel, OutsideGridWarning
from .profile import (
    SCHEMA,
    Profile,
    ProfileMismatchWarning,
    check_profile_fits,
    fingerprint,
    load_profile,
)

SHIPPED_DIR = Path(__file__).parent / "profiles"
CACHE_DIR: Path | None = None
"""Where measured profiles are cached; None: ``$SPARSEBALANCE_CACHE/profiles``, else
``~/.cache/sparsebalance/profiles`` (:func:`~sparsebalance.files.cache_folder`, read per call)."""


def default_latency_model(
    shapes: ModelShapes,
    device: torch.device,
    dtype: str = "fp32",
    backend: str = "torch",
    *,
    block_size: int,
    cache_dir: Path | None = None,
    max_len: int | None = None,
    budget_s: float = 50.0,
    threads: int | None = None,
    layout: str = "threshold",
    given: str = "--profile PATH",
) -> LatencyModel:
    """A latency model for the running setup with no manual step.

    Order: a cached or shipped profile of this setup (:func:`find_profile`: the same
    fingerprint, measured for micro-batches at least as long); otherwise a profile for
    micro-batches up to ``max_len`` tokens (default: the model's context) is measured now (about
    a minute on a 2-core CPU at a few thousand tokens, longer for longer micro-batches, see
    :mod:`.measure`), announced in one line on stderr once a first timing has estimated how long
    it takes (:func:`measuring_line`; ``given``: how the caller passes a profile instead, for that
    line), with a bar of the seconds on a terminal, its noise line printed after, and cached. The
    fingerprint holds the CPU ``threads`` the profile is for (default: this process's count, what
    a trainer rank runs with), the block
    size and the ``layout`` (``top-k`` for top-k budgets, ``threshold`` for gamma): a profile
    serves every budget of its layout kind, not another block size or kind (``docs/latency.md``).
    """
    from .measure import measure_profile, noise_line

    running = fingerprint(shapes, device, dtype, backend, block_size, threads, layout)
    running["max_len"] = max_len or shapes.max_context
    running["schema"] = SCHEMA
    cache = cache_path(shapes, running, cache_dir)
    mine = sorted(cache.parent.glob(f"{cache.name.rsplit('-', 1)[0]}-*.json"))
    found = find_profile(running, [cache, *mine, *sorted(SHIPPED_DIR.glob("*.json"))])
    if found is not None:
        return LatencyModel(found)
    kept = _cache_writable(cache.parent, given, default=not (cache_dir or CACHE_DIR))

    def announce(seconds: float) -> None:  # a few seconds in: the pilot priced the design
        print(measuring_line(shapes.name, running, cache, seconds, given), file=sys.stderr, flush=True)

    profile = measure_profile(
        shapes,
        device,
        dtype,
        backend,
        block_size=block_size,
        max_len=running["max_len"],
        budget_s=budget_s,
        quiet=True,
        threads=running["threads"],
        layout=layout,
        announce=announce,
        progress=True,
    )
    redo = f"to measure again, delete {_home(cache)} and run when the machine is quieter (or pass {given})"
    print(noise_line(profile, redo=redo), file=sys.stderr, flush=True)
    profile.fingerprint["max_len"] = running["max_len"]
    profile.fingerprint["schema"] = SCHEMA
    if kept:
        profile.save(cache)
    return LatencyModel(profile)


def cache_path(shapes: ModelShapes, running: dict, cache_dir: Path | None = None) -> Path:
    """Where the trainer's cache keeps the profile of the fingerprint ``running``."""
    key = hashlib.sha1(json.dumps(running, sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(cache_dir or CACHE_DIR or cache_folder("profiles"))
    return folder / f"{shapes.name.replace('/', '_')}-{key}.json"


def _cache_writable(folder: Path, given: str, default: bool) -> bool:
    """Whether a profile measured now can be kept in ``folder``. When not (a read-only home),
    one line says so before the measuring, which goes on: the profile is used, not kept."""
    why = unwritable(folder)
    if why is None:
        return True
    hint = f"set {CACHE_ENV} to a writable folder" if default else "pass a writable cache_dir"
    print(
        f"sparsebalance: the latency profile cache {folder} cannot be written ({why}): the "
        f"profile measured now is used but not kept, and the next run measures it again; "
        f"{hint}, or pass {given}",
        file=sys.stderr,
        flush=True,
    )
    return False


def find_profile(running: dict, paths: list[Path]) -> Profile | None:
    """The first of ``paths`` holding a profile of the setup ``running`` (a fingerprint with
    ``max_len``), else the one measured for the shortest micro-batches of those that serve it: a
    profile serves when every field is equal but ``max_len``, which may be larger (its tables and
    fitted form cover shorter micro-batches as well: the fit weighs every micro-batch by its
    relative error, the tiny ones of its design included). None when none does; unreadable
    files are passed over."""
    setup = {k: v for k, v in running.items() if k != "max_len"}
    best: Profile | None = None
    for path in paths:
        if not path.is_file():
            continue
        try:
            profile = load_profile(path)
        except ValueError:
            continue
        top = profile.fingerprint.get("max_len")
        theirs = {k: v for k, v in profile.fingerprint.items() if k != "max_len"}
        if theirs != setup or not isinstance(top, int) or top < running["max_len"]:
            continue
        if top == running["max_len"]:
            return profile
        if best is None or top < best.fingerprint["max_len"]:
            best = profile
    return best


def measuring_line(model: str, running: dict, cache: Path, seconds: float, given: str) -> str:
    """The line said before a profile is measured: what, about how long (``seconds``, estimated
    on this machine: :func:`.wait.expected_seconds`), where it is kept, what reuses it, how to
    skip it."""
    cpu = running["device_type"] == "cpu"
    threads = running["threads"]
    where = (
        f"cpu ({threads} thread{'s' if threads != 1 else ''})"
        if cpu
        else f"{running['device_type']} ({running['device']})"
    )
    kind = "top-k" if running.get("layout") == "top-k" else "gamma"
    top = running["max_len"]
    return (
        f"sparsebalance: measuring a latency profile for {model} on {where}, block size "
        f"{running['block_size']}, {kind} budgets, micro-batches up to {top:,} tokens: about "
        f"{_duration(seconds)} (estimated from a first timing here); cached in {_home(cache)} for later "
        f"runs with any {kind} budget and up to {top:,} tokens (another block size or budget kind "
        f"measures its own); pass {given} to skip it"
    )


def _duration(seconds: float) -> str:
    """``70 s``, ``7 min``: how long, as a person says it."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _home(path: Path) -> str:
    """``path`` with the home folder written ``~``."""
    try:
        return "~/" + str(Path(path).relative_to(Path.home()))
    except ValueError:
        return str(path)


def load_cost_model(profile: str | None, model: str = "tiny", accelerator: str = "h100") -> tuple[LatencyModel, str]:
    """``(LatencyModel, one-line description)``: from the measured ``profile`` file (``--profile``)
    if given, else from the analytic (FLOP-count) profile of ``model`` (``--model``) on
    ``accelerator`` (``--accelerator``)."""
    if profile is not None:
        return LatencyModel(load_profile(profile)), f"LatencyModel(profile {profile})"
    desc = f"LatencyModel(analytic profile: {model} on {accelerator})"
    block = resolve_block_size("cuda", backend=None)  # an analytic profile prices a GPU: CUDA's block
    return LatencyModel(analytic_profile(load_shapes(model), accelerator, block_size=block)), desc


__all__ = [
    "ACCELERATORS",
    "ContextCost",
    "LatencyModel",
    "Links",
    "OutsideGridWarning",
    "Profile",
    "ProfileMismatchWarning",
    "allreduce_seconds",
    "analytic_links",
    "analytic_profile",
    "check_profile_fits",
    "context_cost",
    "default_latency_model",
    "find_profile",
    "fingerprint",
    "links_from_profile",
    "load_cost_model",
    "load_profile",
]
