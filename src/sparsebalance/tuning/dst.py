"""DST step level: anchor-guided, bidirectional attention budgets per rank for one step.

Input: every rank's micro-batches (documents with their estimated density at ``gamma0``), a
``CostModel`` (duck-typed: only the protocol in :mod:`sparsebalance.workload` is used) and the
:class:`~sparsebalance.tuning.curve.DensityCurve` that prices any other gamma. Output: a
:class:`~sparsebalance.tuning.records.StepDecision`.

The rule (``mode="bidirectional"``):

1. ``t_r`` = predicted time of rank r at ``gamma0``; ``T* = anchor(t)``.
2. Ranks with ``t_r > (1 + p) T*`` (stragglers) get the largest gamma in ``[gamma_min, gamma0]``
   whose predicted time is ``<= (1 + p) T*`` (bisection on the monotone predicted time), or
   ``gamma_min`` when even that is above.
3. ``T'`` = max over ranks after the cuts. A cut rank counts as ``max((1 + p) T*, time at
   gamma_min)``, the value its cut aims at, so ``T'`` follows from two numbers per rank.
4. Every other rank whose time is below ``T'`` gets the largest gamma in ``[gamma0, gamma_max]``
   whose predicted time is ``<= T'``: it fills its bubble and never becomes the new straggler.

``mode="down"`` stops after step 3; ``mode="off"`` keeps ``gamma0`` everywhere (the baseline and
SAB-only ablations). The tuner is a plain object without state between steps.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .. import flags
from ..workload import CostModel, MicroBatch
from .curve import DensityCurve
from .plan_workload import PlanWorkload, largest_feasible_many
from .records import CUT, KEPT, RAISED, RankDecision, StepDecision, StepTargets

MODES = ("off", "down", "bidirectional")
ANCHORS = ("min", "mean", "median", "max")
_ANCHOR_FNS: dict[str, Callable[[np.ndarray], float]] = {
    "min": np.min,
    "mean": np.mean,
    "median": np.median,
    "max": np.max,
}
# Bisection stops when the gamma interval is this narrow (about 23 halvings of [0.5, 1]).
_GAMMA_TOL = 1e-7


@dataclass(frozen=True)
class DSTConfig:
    """Dynamic sparsity tuning settings (validated on construction). Flags ``--dst.FIELD``
    (:mod:`sparsebalance.flags`); the short aliases in brackets; TOML table ``[dst]``."""

    mode: str = "bidirectional"
    """[--dst-mode] ``off`` (fixed gamma0), ``down`` (cut stragglers only) or ``bidirectional``
    (also raise the budget of ranks that would wait at the gradient sync)."""
    anchor: str = "mean"
    """[--anchor] ``min``, ``mean``, ``median`` or ``max`` of the predicted rank times: the target
    ``T*``. Extreme anchors cut hard (``min``) or never cut (``max``)."""
    p: float = 0.1
    """[--tolerance] tolerance band: ranks above ``(1 + p) T*`` are stragglers (>= 0)."""
    gamma0: float = 0.9
    """[--gamma0] the default budget the planner's densities were estimated at, in (0, 1)."""
    gamma_min: float = 0.5
    """[--gamma-min] the lowest budget a straggler may be cut to, in (0, gamma0]."""
    gamma_max: float = 0.99
    """[--gamma-max] the highest budget a fast rank may be raised to, in [gamma0, 1]."""
    layer_probes: int = 8
    """[--dst-probes] density evaluations per (micro-batch, layer) in the layer controller
    (>= 2; resolution about (gamma_max - gamma_min) / 2**(probes - 2))."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--dst-mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.anchor not in ANCHORS:
            raise ValueError(f"--anchor must be one of {', '.join(ANCHORS)}, got {self.anchor!r}")
        for flag, value in (
            ("--tolerance", self.p),
            ("--gamma0", self.gamma0),
            ("--gamma-min", self.gamma_min),
            ("--gamma-max", self.gamma_max),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{flag} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{flag} must be finite, got {value}")
        if self.p < 0:
            raise ValueError(f"--tolerance must be >= 0, got {self.p}")
        if self.mode == "off":  # a fixed budget: gamma0 = 1 is dense attention; bounds unused
            if not 0.0 < self.gamma0 <= 1.0:
                raise ValueError(
                    f"--gamma0 must be in (0, 1] with --dst-mode off, got {self.gamma0}"
                )
            return
        if not 0.0 < self.gamma0 < 1.0:
            raise ValueError(
                f"--gamma0 must be in (0, 1) when DST tunes budgets, got {self.gamma0} "
                "(--gamma0 1 = dense attention needs --dst-mode off)"
            )
        if not 0.0 < self.gamma_min <= self.gamma0:
            raise ValueError(
                f"--gamma-min must be in (0, --gamma0={self.gamma0}], got {self.gamma_min}"
            )
        if not self.gamma0 <= self.gamma_max <= 1.0:
            raise ValueError(
                f"--gamma-max must be in [--gamma0={self.gamma0}, 1], got {self.gamma_max}"
            )
        probes = self.layer_probes
        if isinstance(probes, bool) or not isinstance(probes, int) or probes < 2:
            raise ValueError(f"--dst-probes must be an integer >= 2, got {probes!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DSTConfig:
        """Build from the flags :func:`add_dst_arguments` defines (unset flags keep defaults)."""
        return flags.build(cls, flags.values_from_args(args, cls, ("dst",)), "DST flags")


def add_dst_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the DST flags (one argument group, generated from :class:`DSTConfig`'s fields:
    ``--dst.gamma-min`` etc., with the short aliases ``--gamma-min``, ``--anchor``, ...)."""
    flags.add_arguments(parser, DSTConfig, ("dst",), title="dynamic sparsity tuning (DST)")


class RankWorkload:
    """One rank's micro-batches as padded ``(M, K)`` arrays, priced at any gamma: the scalar
    reference that :class:`PlanWorkload` (all ranks at once, what :meth:`DSTTuner.decide` uses)
    is tested against, bit for bit, through :meth:`DSTTuner.decide_rank`.

    ``lengths`` int64 ``(M, K)`` (0 = empty slot) and ``d0`` float64 ``(M, K)`` (1.0 in empty
    slots); ``seconds(gamma)`` is ``sum(cost_model.predict_many(lengths, curve(d0, gamma)))``.
    """

    def __init__(
        self, microbatches: Sequence[MicroBatch], cost_model: CostModel, curve: DensityCurve
    ) -> None:
        m = len(microbatches)
        k = max((len(mb.lengths) for mb in microbatches), default=0)
        self.lengths = np.zeros((m, k), dtype=np.int64)
        self.d0 = np.ones((m, k), dtype=np.float64)
        for i, mb in enumerate(microbatches):
            self.lengths[i, : len(mb.lengths)] = mb.lengths
            self.d0[i, : len(mb.densities)] = mb.densities
        self.cost_model = cost_model
        self.curve = curve
        self._weights = self.lengths.astype(np.float64) ** 2

    def densities(self, gamma: float) -> np.ndarray:
        """``(M, K)`` predicted densities at ``gamma``."""
        return self.curve.density(self.d0, gamma)

    def seconds(self, gamma: float) -> float:
        """Predicted forward + backward seconds of all micro-batches at ``gamma``."""
        if self.lengths.shape[0] == 0:  # no micro-batch at all (an empty one still has overhead)
            return 0.0
        return float(np.sum(self.cost_model.predict_many(self.lengths, self.densities(gamma))))

    def attention_seconds(self, gamma: float) -> float:
        """Predicted attention seconds (all layers) at ``gamma``."""
        if self.lengths.size == 0:
            return 0.0
        valid = self.lengths > 0  # padded slots are not documents (a cost model may reject 0)
        per_layer = np.zeros(self.lengths.shape)
        per_layer[valid] = self.cost_model.layer_attention_seconds(
            self.lengths[valid], self.densities(gamma)[valid]
        )
        return float(self.cost_model.num_layers * np.sum(per_layer))

    def mean_density(self, gamma: float) -> float:
        """Length²-weighted mean density at ``gamma`` (1.0 for an empty rank)."""
        total = self._weights.sum()
        return float((self._weights * self.densities(gamma)).sum() / total) if total else 1.0


@dataclass(frozen=True)
class StepArrays:
    """:meth:`DSTTuner.decide_arrays`: a :class:`StepDecision`'s numbers as ``(R,)`` float64
    arrays (rank order), the per-rank fields of :class:`RankDecision` by name."""

    targets: StepTargets
    gammas: np.ndarray
    times_after: np.ndarray
    density_before: np.ndarray
    density_after: np.ndarray
    attention_before: np.ndarray
    attention_after: np.ndarray


class DSTTuner:
    """Step-level DST (see the module docstring). Stateless between calls."""

    def __init__(self, config: DSTConfig | None = None, curve: DensityCurve | None = None) -> None:
        self.config = config or DSTConfig()
        self.curve = curve or DensityCurve(gamma0=self.config.gamma0)
        if self.curve.gamma0 != self.config.gamma0:
            raise ValueError(
                f"the density curve was built for gamma0={self.curve.gamma0}, "
                f"but --gamma0 is {self.config.gamma0}"
            )

    def workload(self, microbatches: Sequence[MicroBatch], cost_model: CostModel) -> RankWorkload:
        return RankWorkload(microbatches, cost_model, self.curve)

    def rank_times(
        self, microbatches: Sequence[MicroBatch], cost_model: CostModel
    ) -> tuple[float, float]:
        """This rank's predicted time at ``gamma0`` and at ``gamma_min`` (what ranks exchange)."""
        w = self.workload(microbatches, cost_model)
        return w.seconds(self.config.gamma0), w.seconds(self.config.gamma_min)

    def step_targets(
        self, times_before: Sequence[float], times_floor: Sequence[float]
    ) -> StepTargets:
        """Anchor, cut threshold, ``T'`` and roles from ``(R,)`` times at ``gamma0`` and
        ``gamma_min``. Pure and deterministic: every rank computes the same from the same times."""
        cfg = self.config
        t0 = np.asarray(times_before, dtype=np.float64)
        tf = np.asarray(times_floor, dtype=np.float64)
        if t0.ndim != 1 or t0.shape != tf.shape or t0.size == 0:
            raise ValueError(
                f"times_before and times_floor must be two (R,) arrays with R >= 1, "
                f"got {t0.shape} and {tf.shape}"
            )
        anchor = float(_ANCHOR_FNS[cfg.anchor](t0))
        threshold = (1.0 + cfg.p) * anchor
        cut = np.zeros(t0.shape, dtype=bool) if cfg.mode == "off" else t0 > threshold
        post_cut = float(np.where(cut, np.maximum(threshold, tf), t0).max())
        raise_ = (cfg.mode == "bidirectional") & ~cut & (t0 < post_cut)
        roles = tuple(CUT if c else RAISED if r else KEPT for c, r in zip(cut, raise_, strict=True))
        return StepTargets(
            anchor_seconds=anchor,
            cut_threshold=threshold,
            post_cut_seconds=post_cut,
            times_before=tuple(float(x) for x in t0),
            times_floor=tuple(float(x) for x in tf),
            roles=roles,
        )

    def decide_rank(
        self,
        rank: int,
        microbatches: Sequence[MicroBatch],
        cost_model: CostModel,
        targets: StepTargets,
    ) -> RankDecision:
        """One rank's budget given the shared ``targets`` (needs only its own micro-batches):
        the per-rank reference of :meth:`decide`, one scalar bisection per rank."""
        cfg = self.config
        w = self.workload(microbatches, cost_model)
        role = targets.roles[rank]
        gamma = cfg.gamma0
        if role == CUT:
            if targets.times_floor[rank] > targets.cut_threshold:
                gamma = cfg.gamma_min
            else:
                gamma = _largest_feasible(
                    w.seconds, cfg.gamma_min, cfg.gamma0, targets.cut_threshold
                )
        elif role == RAISED:
            gamma = _largest_feasible(
                w.seconds, cfg.gamma0, cfg.gamma_max, targets.post_cut_seconds
            )
        after = w.seconds(gamma)
        return RankDecision(
            rank=rank,
            role=role,
            gamma=gamma,
            target_seconds=after,
            predicted_before=targets.times_before[rank],
            predicted_after=after,
            density_before=w.mean_density(cfg.gamma0),
            density_after=w.mean_density(gamma),
            attention_before=w.attention_seconds(cfg.gamma0),
            attention_after=w.attention_seconds(gamma),
        )

    def decide(
        self,
        plan: Sequence[Sequence[MicroBatch]],
        cost_model: CostModel,
        workload: PlanWorkload | None = None,
    ) -> StepDecision:
        """The whole step from the plan (rank -> micro-batches), identical on every rank.

        Vectorised over ranks (:mod:`.plan_workload`): the same gammas and times as
        :meth:`decide_rank` for every rank, in a few ``predict_many`` calls per bisection probe.
        ``workload``: a :class:`PlanWorkload` of this plan, cost model and curve, to share its
        prices between several tuners (the simulator's ablations); built here when ``None``.
        """
        if len(plan) == 0:
            raise ValueError("DST needs at least one rank in the plan, got 0")
        if workload is None:
            workload = PlanWorkload(plan, cost_model, self.curve)
        elif not (workload.num_ranks == len(plan) and workload.cost_model is cost_model):
            raise ValueError("decide: the workload was built for another plan, cost model or curve")
        a = self.decide_arrays(workload)
        ranks = tuple(
            RankDecision(r, role, g, t, b, t, db, da, ab, aa)
            for r, (role, g, t, b, db, da, ab, aa) in enumerate(zip(
                a.targets.roles, a.gammas.tolist(), a.times_after.tolist(),
                a.targets.times_before, a.density_before.tolist(), a.density_after.tolist(),
                a.attention_before.tolist(), a.attention_after.tolist(), strict=True,
            ))
        )  # fmt: skip
        return self.assemble(a.targets, ranks)

    def decide_arrays(self, workload: PlanWorkload) -> StepArrays:
        """:meth:`decide` on a plan's :class:`PlanWorkload`, as ``(R,)`` arrays without one
        :class:`RankDecision` per rank (what the simulator reads for thousands of ranks)."""
        if workload.num_ranks == 0:
            raise ValueError("DST needs at least one rank in the plan, got 0")
        if workload.curve != self.curve:
            raise ValueError("decide: the workload was built for another plan, cost model or curve")
        cfg = self.config
        work = workload
        num_ranks = work.num_ranks
        full = np.ones(num_ranks, dtype=bool)
        g0 = np.full(num_ranks, cfg.gamma0)
        gmin = np.full(num_ranks, cfg.gamma_min)
        gmax = np.full(num_ranks, cfg.gamma_max)
        targets = self.step_targets(work.seconds(g0), work.seconds(gmin))
        roles = np.asarray(targets.roles)
        floor = np.asarray(targets.times_floor) > targets.cut_threshold
        cut = (roles == CUT) & ~floor
        gamma = np.where((roles == CUT) & floor, cfg.gamma_min, cfg.gamma0)
        limit = np.full(num_ranks, targets.cut_threshold)
        gamma = np.where(cut, largest_feasible_many(work, gmin, g0, limit, cut, _GAMMA_TOL), gamma)
        raised = roles == RAISED
        limit = np.full(num_ranks, targets.post_cut_seconds)
        gamma = np.where(raised, largest_feasible_many(work, g0, gmax, limit, raised, _GAMMA_TOL),
                         gamma)  # fmt: skip
        return StepArrays(
            targets=targets,
            gammas=gamma,
            times_after=work.seconds(gamma, full),
            density_before=work.mean_density(g0),
            density_after=work.mean_density(gamma),
            attention_before=work.attention_seconds(g0),
            attention_after=work.attention_seconds(gamma),
        )

    def assemble(self, targets: StepTargets, ranks: Sequence[RankDecision]) -> StepDecision:
        """A :class:`StepDecision` from shared targets and every rank's decision."""
        cfg = self.config
        return StepDecision(cfg.mode, cfg.anchor, cfg.p, targets, tuple(ranks))


def _largest_feasible(f: Callable[[float], float], lo: float, hi: float, limit: float) -> float:
    """Largest gamma in ``[lo, hi]`` with ``f(gamma) <= limit``, for ``f`` non-decreasing and
    ``f(lo) <= limit`` (the caller's precondition). Only evaluated-feasible points are returned,
    so the result satisfies the limit even if ``f`` is not exactly monotone."""
    if f(hi) <= limit:
        return hi
    while hi - lo > _GAMMA_TOL:
        mid = 0.5 * (lo + hi)
        if f(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo
