"""DST settings: :class:`DSTConfig` (flags ``--dst.FIELD``, TOML table ``[dst]``) and the knob it
describes (:meth:`DSTConfig.knob`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from .. import flags
from .curve import DensityCurve
from .knob import GammaKnob, Knob, knob_from_tokens

MODES = ("off", "down", "bidirectional")
ANCHORS = ("min", "mean", "median", "max")
BUDGETS = ("top-k", "gamma")
RAISE_TO = ("anchor", "step")
_GAMMA_FIELDS = ("gamma0", "gamma_min", "gamma_max")
_TOPK_FIELDS = ("budget_tokens", "budget_tokens_min", "budget_tokens_max")


DEFAULT_BUDGET_TOKENS = 8192
"""Top-k's default base budget in tokens attended (the paper's 32 blocks x 256 = 8,192): what
every front end and command runs at when no budget is given."""


@dataclass(frozen=True)
class DSTConfig:
    """Dynamic sparsity tuning settings (validated on construction). Flags ``--dst.FIELD``
    (:mod:`sparsebalance.flags`); the short aliases in brackets; TOML table ``[dst]``."""

    mode: str = "bidirectional"
    """[--dst-mode] ``off`` (the base budget everywhere), ``down`` (cut bottlenecks only) or
    ``bidirectional`` (also raise the budget of workers that would wait at the gradient sync)."""
    anchor: str = "mean"
    """[--anchor] ``min``, ``mean``, ``median`` or ``max`` of the workers' predicted times at the
    base budget: the target ``T_anchor``. ``min`` cuts hard, ``max`` never cuts."""
    p: float = 0.1
    """[--coverage-bound] the paper's p: a cut may lose at most this much of the gate's coverage,
    ``C(base) - C(k) <= p`` (in [0, 1]; 0 never cuts below the base budget, 1 disables the
    bound). Before config schema 2 this key meant the time band, now ``tolerance``."""
    tolerance: float = 0.0
    """[--tolerance] time band: workers above ``(1 + tolerance) T_anchor`` are bottlenecks and
    are cut to it (>= 0; 0 is the paper's rule)."""
    raise_to: str = "anchor"
    """[--raise-to] how far others are raised: ``anchor`` (the paper: the largest budget predicted
    within ``T_anchor``) or ``step`` (within the step time left after the cuts)."""
    budget: str = "top-k"
    """[--budget] the budget kind DST tunes: ``top-k`` (MoBA: k key blocks per query, the paper's)
    or ``gamma`` (the fewest blocks whose estimated attention mass reaches gamma)."""
    budget_tokens: int = DEFAULT_BUDGET_TOKENS
    """[--budget-tokens] top-k: the base budget in tokens attended, k x block size (the paper's
    32 x 256 = 8,192), so a block-size change keeps the budget."""
    budget_tokens_min: int | None = None
    """[--budget-tokens-min] top-k: the smallest budget a cut may reach (default: a quarter of
    the base)."""
    budget_tokens_max: int | None = None
    """[--budget-tokens-max] top-k: the largest budget a raise may reach (default: exact
    attention on the worker's longest document)."""
    gamma0: float = 0.9
    """[--gamma0] gamma: the base budget the planner's densities were estimated at, in (0, 1)."""
    gamma_min: float = 0.5
    """[--gamma-min] gamma: the lowest budget a cut may reach, in (0, gamma0]."""
    gamma_max: float = 0.99
    """[--gamma-max] gamma: the highest budget a raise may reach, in [gamma0, 1]."""
    skew_margin: float = 2.0
    """[--skew-margin] how far the latency model's split between attention and the rest may be
    off, as a factor >= 1: a raise stops where the raised worker would pass the slowest other
    worker if attention cost this many times more, or less, than predicted (a cut is safe
    either way). 1 trusts the model fully. A latency profile measured on another load or machine
    is off in this split, and a raise that overshoots makes a new straggler (issue 56)."""
    layer_feedback: bool = False
    """[--layer-feedback] CPU only: feed each layer's measured forward time (x 3 for its
    backward) into the per-layer choices of the rest of the step. Off by default: the choices
    then follow predicted times, and on a 2-core CPU the closed loop measured slower than that
    (forward timings mislead it: DST +SAB ran 1.2x slower than SAB alone, see docs/sab-dst.md)."""
    layer_probes: int = 8
    """[--dst-probes] budget evaluations per (micro-batch, layer) in the layer controller
    (>= 2; gamma: resolution about (gamma_max - gamma_min) / 2**(probes - 2); top-k: the
    bisection on k stops earlier when it reaches one block)."""

    def __post_init__(self) -> None:
        flags.check_fields(self)  # types first (the Python API): one line naming the field
        name = lambda field: flags.name(self, field)  # noqa: E731  (--flag, or DSTConfig.field)
        for field, allowed in (("mode", MODES), ("anchor", ANCHORS), ("raise_to", RAISE_TO), ("budget", BUDGETS)):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"{name(field)} must be one of {', '.join(allowed)}, got {value!r}")
        for field in ("p", "tolerance", "skew_margin", "gamma0", "gamma_min", "gamma_max"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name(field)} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name(field)} must be finite, got {value}")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"{name('p')} (the paper's p) must be in [0, 1], got {self.p}")
        if not self.skew_margin >= 1.0:
            raise ValueError(f"{name('skew_margin')} must be a number >= 1, got {self.skew_margin}")
        if self.tolerance < 0:
            raise ValueError(f"{name('tolerance')} must be >= 0, got {self.tolerance}")
        probes = self.layer_probes
        if isinstance(probes, bool) or not isinstance(probes, int) or probes < 2:
            raise ValueError(f"{name('layer_probes')} must be an integer >= 2, got {probes!r}")
        self._check_kind_fields()
        if self.budget == "top-k":
            self._check_tokens()
        else:
            self._check_gammas()

    def _check_kind_fields(self) -> None:
        """A field of the other budget kind set to a non-default value would be ignored: refuse."""
        other = _GAMMA_FIELDS if self.budget == "top-k" else _TOPK_FIELDS
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        changed = [n for n in other if getattr(self, n) != defaults[n]]
        if changed:
            names = ", ".join(flags.name(self, n) for n in changed)
            other_kind = "gamma" if self.budget == "top-k" else "top-k"
            verb, them = ("applies", "it") if len(changed) == 1 else ("apply", "them")
            raise ValueError(
                f"{names} only {verb} to {flags.name(self, 'budget')} {other_kind}: drop {them}, "
                f"or set the budget kind to {other_kind} (it is {self.budget})"
            )

    def _check_tokens(self) -> None:
        name = lambda field: flags.name(self, field)  # noqa: E731
        for field in ("budget_tokens", "budget_tokens_min", "budget_tokens_max"):
            value = getattr(self, field)
            if value is None and field != "budget_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name(field)} must be an integer >= 0 (tokens), got {value!r}")
        lo, hi, base = self.budget_tokens_min, self.budget_tokens_max, self.budget_tokens
        if lo is not None and lo > base:
            raise ValueError(f"{name('budget_tokens_min')} ({lo}) must be <= {name('budget_tokens')} ({base})")
        if hi is not None and hi < base:
            raise ValueError(f"{name('budget_tokens_max')} ({hi}) must be >= {name('budget_tokens')} ({base})")

    def _check_gammas(self) -> None:
        name = lambda field: flags.name(self, field)  # noqa: E731
        g0 = self.gamma0
        if self.mode == "off":  # a fixed budget: gamma0 = 1 is dense attention; bounds unused
            if not 0.0 < g0 <= 1.0:
                raise ValueError(f"{name('gamma0')} must be in (0, 1] with {name('mode')} off, got {g0}")
            return
        if not 0.0 < g0 < 1.0:
            raise ValueError(
                f"{name('gamma0')} must be in (0, 1) when DST tunes budgets, got {g0} "
                f"(gamma0 1 = dense attention needs {name('mode')} off)"
            )
        if not 0.0 < self.gamma_min <= g0:
            raise ValueError(f"{name('gamma_min')} must be in (0, gamma0={g0}], got {self.gamma_min}")
        if not g0 <= self.gamma_max <= 1.0:
            raise ValueError(f"{name('gamma_max')} must be in [gamma0={g0}, 1], got {self.gamma_max}")

    def knob(self, block_size: int, curve: DensityCurve | None = None, anchor_blocks: int = 2) -> Knob:
        """The knob these settings describe, for a model run at ``block_size`` (top-k budgets are
        stated in tokens) with the density ``curve`` (gamma; default the prior)."""
        if self.budget == "top-k":
            return knob_from_tokens(
                self.budget_tokens, block_size, self.budget_tokens_min, self.budget_tokens_max, anchor_blocks
            )
        curve = curve or DensityCurve(gamma0=self.gamma0)
        if curve.gamma0 != self.gamma0:
            raise ValueError(f"the density curve was built for gamma0={curve.gamma0}, but --gamma0 is {self.gamma0}")
        if self.mode == "off":
            return GammaKnob(curve, self.gamma0, self.gamma0)
        return GammaKnob(curve, self.gamma_min, self.gamma_max)

    def describe(self) -> str:
        """One line: the budget and the rule (for reports and command output)."""
        if self.budget == "top-k":
            lo = self.budget_tokens_min if self.budget_tokens_min is not None else "base/4"
            hi = self.budget_tokens_max if self.budget_tokens_max is not None else "dense"
            budget = f"top-k {self.budget_tokens} tokens (cuts to {lo}, raises to {hi})"
        else:
            budget = f"gamma0 {self.gamma0} in [{self.gamma_min}, {self.gamma_max}]"
        rule = f"p = {self.p}, anchor {self.anchor}, raise to {self.raise_to}"
        if self.mode == "bidirectional" and self.skew_margin != 1.0:
            rule += f" (safe for a {self.skew_margin:g}x skew)"
        if self.tolerance:
            rule += f", tolerance {self.tolerance}"
        return f"{budget}; DST {self.mode}: {rule}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DSTConfig:
        """Build from the flags :func:`add_dst_arguments` defines (unset flags keep defaults)."""
        return flags.build(cls, flags.values_from_args(args, cls, ("dst",)), "DST flags")


def add_dst_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the DST flags (one argument group, generated from :class:`DSTConfig`'s fields:
    ``--dst.gamma-min`` etc., with the short aliases ``--gamma-min``, ``--anchor``, ...)."""
    flags.add_arguments(parser, DSTConfig, ("dst",), title="dynamic sparsity tuning (DST)")
