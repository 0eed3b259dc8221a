"""Shared test configuration: the ``gpu`` marker skips without CUDA; hypothesis profiles; small
tensor helpers.

Property tests (hypothesis) run under a profile chosen by ``HYPOTHESIS_PROFILE``:

- ``ci`` (the default): derandomized -- every run on every machine draws the same examples, so a
  test can only fail because the code changed; no deadline and no ``too_slow`` health check
  (wall-clock checks on a loaded machine are not reproducible); no example database.
- ``explore``: fresh random draws, at least ``HYPOTHESIS_EXAMPLES`` (default 200) examples per
  test, seed settable with pytest's ``--hypothesis-seed=N``::

      HYPOTHESIS_PROFILE=explore bash scripts/test.sh -q \\
          tests/simulate/test_engine.py tests/tuning tests/batching/test_planner.py \\
          --hypothesis-seed=1

  Every counterexample it finds is kept in its test as an explicit ``@example``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
EXPLORE_EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "200"))
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "explore",
    derandomize=False,
    deadline=None,
    max_examples=EXPLORE_EXAMPLES,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
if PROFILE not in ("ci", "explore"):
    raise ValueError(f"HYPOTHESIS_PROFILE must be ci or explore, got {PROFILE!r}")
settings.load_profile(PROFILE)


def examples(ci: int) -> int:
    """``max_examples`` of a property test: ``ci`` under the CI profile (its time budget), at
    least :data:`EXPLORE_EXAMPLES` under ``explore`` (a test's own ``@settings`` would otherwise
    cap the exploration at its CI budget)."""
    return max(ci, EXPLORE_EXAMPLES) if PROFILE == "explore" else ci


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_qkv(total, hq, hkv, dim, dtype=torch.float64, device="cpu", seed=0, requires_grad=True):
    """Random ``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for h in (hq, hkv, hkv):
        x = torch.randn(total, h, dim, generator=g, dtype=torch.float64).to(device, dtype)
        out.append(x.requires_grad_(requires_grad))
    return out


def cu_from_lengths(lengths, device="cpu"):
    """int32 ``cu_seqlens`` from document lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS difference ||a - b|| / ||b|| (fla style)."""
    return float((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt().clamp_min(1e-30))
