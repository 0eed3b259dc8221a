"""The SAB planner: global batch -> :class:`~sparsebalance.batching.plan.Plan`.

Pipeline: validate -> densities (given, or from an estimator) -> over-long documents handled per
``overlong`` -> items with predicted seconds (``cost_model.doc_seconds``) -> a strategy assigns
items to ranks and micro-batches -> ``cost_model.predict_many`` times every micro-batch -> Plan.

Strategies (one interface, :data:`STRATEGIES`):

- ``sequential``: dataset order, contiguous equal-count shards per rank (the usual baseline);
- ``sorted``: the same on length-sorted samples (LongAlign-style sorted batching);
- ``lbb``: length-based batching, the SparseBalance paper's baseline: length-sorted samples cut
  into consecutive micro-batches, dealt to ranks in snake order;
- ``tokens``: LPT on token counts;
- ``flops``: LPT on ``c L + L^2`` (what verl / slime balance), ``c`` from the model's shapes
  (:func:`~.strategies.flops_linear_coef`; the latency profile's fingerprint holds them) unless
  given, fitted to the cost model's dense document time when it has no shapes;
- ``sab``: LPT on predicted seconds (density-aware, micro-batch overheads counted), refined by
  moves/swaps between the heaviest and the lightest ranks; the plain ``tokens`` plan is also
  timed and kept if it is predicted faster, so ``sab`` is never worse than ``tokens`` under the
  same cost model (``metrics.candidate`` says which won); with padded micro-batches
  (``pad_micro_batches``, the simulator's) it also prices length-grouped plans (:mod:`.padding`);
- ``sab-cp``: ``sab`` plus context parallelism per document (:mod:`.context`): long documents
  run on units of k ranks when that shortens the step; never slower than ``sab`` (it times both).
  Needs a :class:`~sparsebalance.latency.context.ContextCost`; ``--overlong`` applies above
  ``R x C`` tokens only (shorter documents over C run on ``ceil(L / C)`` ranks or more).

Inside a rank, ``sequential``/``sorted`` pack in order (``lbb`` keeps its buckets); the others
balance their own key across the rank's micro-batches (the secondary objective). Only the cost
model's protocol is used.

The strategies' assignments live in :mod:`.assign`.

Complexity (N items, R ranks, I local-search exchanges, n = N/R): O(N log N) for LPT,
O(I (R log R + n log n)) for the search, O(N log n) packing, one vectorised ``predict_many``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..latency.context import ContextCost
from ..sizes import check_memory, plan_bytes
from ..workload import CostModel, Sample
from .assign import baseline_packs, sab_packs, sab_pipeline_packs
from .context import CPResult, plan_cp
from .cp_plan import build_cp_plan
from .estimate import DensityEstimator
from .interleaved import check_virtual
from .pipeline import PipelineShape, check_weight_share
from .plan import FlatPacks, Items, Plan, build_plan, flatten_packs, predict_packs
from .schedule import BACKWARD_RATIO
from .strategies import (
    Regime,
)
from .zero_bubble import WEIGHT_SHARE, check_schedule

STRATEGIES = ("sequential", "sorted", "lbb", "tokens", "flops", "sab", "sab-cp")
OVERLONG = ("split", "truncate", "skip")
DEFAULT_CAPACITY = 4096
"""Tokens per micro-batch when neither a capacity nor a micro-batch count is given: ``train``'s,
``plan``'s and ``simulate``'s alike."""


@dataclass(frozen=True)
class PlanConfig:
    """How to plan one global batch (validated on construction; messages name the CLI flags)."""

    world_size: int
    """Data-parallel ranks R (``--world-size``)."""
    micro_batches: int | None = None
    """Micro-batches per rank M (``--micro-batches``); exactly one of this and ``capacity``."""
    capacity: int | None = None
    """Token capacity per micro-batch C, the memory bound (``--capacity``)."""
    strategy: str = "sab"
    """One of :data:`STRATEGIES` (``--strategy``)."""
    overlong: str = "split"
    """Documents longer than C (``--overlong``): ``split`` into C-token chunks trained as separate
    documents, ``truncate`` to their first C tokens, or ``skip``. Counted in the metrics. With
    ``sab-cp`` the limit is ``R x C`` (a unit of R ranks holds R x C tokens)."""
    local_search_iters: int | None = None
    """Most exchanges in ``sab``'s refinement (``--local-search-iters``); default 4 R + 64."""
    neighbors: int = 4
    """Light ranks tried against the heaviest one per refinement step."""
    flops_linear_coef: float | None = None
    """``c`` of the ``flops`` key; default from the cost model's model shapes (else fitted)."""
    cp_degree: int | None = None
    """A fixed CP degree K (``--cp``, ``sab-cp`` only): every CP unit has exactly K ranks, on
    the aligned groups ``[jK, (j + 1) K)`` of a ``(dp, cp)`` mesh, and ``--overlong`` applies
    above ``K x C``. None: ``sab-cp`` picks any k per document."""
    ranks_per_node: int | None = None
    """Ranks sharing a node G (``--ranks-per-node``, the run's topology): ``sab-cp`` keeps a unit
    of k <= G ranks inside one node, prices rings that span nodes at the inter-node link and
    runs them hierarchical (inner ring = a node); default: the cost model's ``links``."""
    pipeline_stages: int = 1
    """Pipeline stages P per data-parallel rank (``--pp``): each rank is a pipeline of P stages
    (1F1B, or ``pipeline_schedule``'s). With P > 1, ``sab`` packs and orders each rank's
    micro-batches for the least makespan of that schedule and evens the ranks' makespans, not
    their totals (:mod:`.pipeline`); the other strategies are unchanged. At most the model's
    layers; not with ``sab-cp``. 1: no pipeline, every plan exactly as without the field."""
    stage_layers: tuple[int, ...] = ()
    """Decoder layers per pipeline stage (P entries, each >= 1, summing to the model's layers; the
    trainer's split, :func:`~.schedule.balanced_layers`); empty: the even split
    (:func:`~.schedule.stage_layers`). The planner prices stages with it, as DST, the simulator
    and the trainer's stages do. With ``pipeline_virtual`` V > 1: P V entries, per virtual stage."""
    pipeline_virtual: int = 1
    """Chunks of layers per pipeline rank (``--pp-virtual`` V): SAB and DST price the interleaved
    1F1B makespan (:mod:`.interleaved`); 1: plain 1F1B."""
    pipeline_schedule: str = "1f1b"
    """The pipeline schedule (``--pp-schedule``, one of :data:`~.zero_bubble.SCHEDULES`):
    ``"1f1b"`` (interleaved with ``pipeline_virtual`` V > 1), or ``"zb-h1"``, zero bubble: SAB and
    DST price the ZB-H1 makespan (:mod:`.zero_bubble`; needs P >= 2 and V = 1). With P = 1 and
    ``"1f1b"`` every plan is exactly as without the field."""
    weight_share: float = WEIGHT_SHARE
    """W's share of a stage's backward with which ``"zb-h1"`` is priced, in [0, 1) (the weight
    gradients', which nobody waits for; a training run's measured share; default
    :data:`~.zero_bubble.WEIGHT_SHARE`, an estimate). Read only with ``"zb-h1"``."""
    stage_scales: tuple[float, ...] = ()
    """Multiplies each pipeline stage's share of a micro-batch's predicted seconds (P entries > 0;
    a training run's measured stage scales, :mod:`sparsebalance.engine.stage_calibration`);
    empty: 1 for every stage."""
    backward_ratio: float = BACKWARD_RATIO
    """Backward seconds per forward second with which pipeline stages are priced (a training
    run's measured ratio; default :data:`~.schedule.BACKWARD_RATIO`)."""
    pad_micro_batches: bool = False
    """Price every micro-batch as run without packing, each document padded to the micro-batch's
    longest (``--pad-micro-batches``, the simulator's model of Megatron-style ``(K, S)`` batches,
    :mod:`.padding`); ``sab`` then also tries length-grouped micro-batches. Needs
    ``micro_batches``; not with ``sab-cp``. The trainer packs: never set for training."""

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise ValueError(f"--world-size must be an integer, got {self.world_size!r}")
        if self.world_size <= 0:
            raise ValueError(f"--world-size must be >= 1, got {self.world_size}")
        if (self.micro_batches is None) == (self.capacity is None):
            raise ValueError("give exactly one of --micro-batches M and --capacity C")
        if self.micro_batches is not None and self.micro_batches <= 0:
            raise ValueError(f"--micro-batches must be >= 1, got {self.micro_batches}")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"--capacity must be >= 1, got {self.capacity}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)} (or all), got {self.strategy!r}")
        if self.overlong not in OVERLONG:
            raise ValueError(f"--overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}")
        if self.local_search_iters is not None and self.local_search_iters < 0:
            raise ValueError(f"--local-search-iters must be >= 0, got {self.local_search_iters}")
        if self.neighbors <= 0:
            raise ValueError(f"neighbors must be >= 1, got {self.neighbors}")
        if self.cp_degree is not None:
            k = self.cp_degree
            if isinstance(k, bool) or not isinstance(k, int) or k < 2:
                raise ValueError(f"--cp must be an integer >= 2, got {k!r}")
            if self.strategy != "sab-cp":
                raise ValueError(f"--cp {k} needs --strategy sab-cp (got {self.strategy!r})")
            if self.world_size % k:
                raise ValueError(
                    f"--cp {k} must divide the world size ({self.world_size}): the ranks form "
                    f"{self.world_size} / K context-parallel groups"
                )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node must be >= 1, got {self.ranks_per_node}")
        p = self.pipeline_stages
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"--pp must be an integer >= 1, got {p!r}")
        if p > 1 and self.strategy == "sab-cp":
            raise ValueError(f"--pp {p}: pipelines are not planned with context-parallel plans (sab-cp); use --pp 1")
        split = self.stage_layers
        if not isinstance(split, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) for n in split):
            raise ValueError(f"stage_layers must be a tuple of integers, got {split!r}")
        check_virtual(p, self.pipeline_virtual)
        check_schedule(self.pipeline_schedule, p, self.pipeline_virtual)
        check_weight_share(self.weight_share)
        if split and (len(split) != p * self.pipeline_virtual or min(split) < 1):
            per = f"--pp {p}" + (f" x --pp-virtual {self.pipeline_virtual}" if self.pipeline_virtual > 1 else "")
            raise ValueError(f"stage_layers {split}: need one entry >= 1 per pipeline stage ({per})")
        scales = self.stage_scales
        if not isinstance(scales, tuple) or (scales and len(scales) != p):
            raise ValueError(f"stage_scales must be a tuple of one scale per pipeline stage (--pp {p}), got {scales!r}")
        if not all(np.isfinite(x) and x > 0 for x in scales):
            raise ValueError(f"stage_scales must be finite and > 0, got {scales!r}")
        if not (np.isfinite(self.backward_ratio) and self.backward_ratio >= 0):
            raise ValueError(f"backward_ratio must be finite and >= 0, got {self.backward_ratio!r}")
        if self.pad_micro_batches and self.capacity is not None:
            raise ValueError(
                "--pad-micro-batches needs --micro-batches M, not --capacity (a padded micro-batch is K "
                "documents of its longest's length, not a token budget)"
            )
        if self.pad_micro_batches and self.strategy == "sab-cp":
            raise ValueError("--pad-micro-batches: context-parallel plans (sab-cp) are not padded; use sab")

    def pipeline(self, num_layers: int) -> PipelineShape | None:
        """How SAB and DST price a rank as a pipeline of a ``num_layers`` model (the schedule, the
        split, the stage scales, the backward ratio, ZB-H1's weight share); None without a
        pipeline."""
        if self.pipeline_stages == 1:
            return None
        return PipelineShape.of(
            num_layers,
            self.pipeline_stages,
            self.stage_layers,
            self.backward_ratio,
            self.stage_scales,
            self.pipeline_virtual,
            self.weight_share if self.pipeline_schedule == "zb-h1" else None,
        )


def plan_batch(
    samples: Sequence[Sample],
    cost_model: CostModel,
    config: PlanConfig,
    densities: Sequence[float] | np.ndarray | None = None,
    estimator: DensityEstimator | None = None,
) -> Plan:
    """Plan one global batch.

    Args:
        samples: the global batch, ``N >= 1`` samples with distinct ids.
        cost_model: anything with the :class:`~sparsebalance.workload.CostModel` methods.
        config: world size, M or C, strategy, over-long policy.
        densities: ``(N,)`` expected densities in (0, 1] at the default budget; or
        estimator: an object with ``estimate(samples) -> (N,)``. Exactly one of the two.

    Returns:
        A :class:`Plan`; split chunks carry the sample's density (the estimate of the whole).
    """
    t0 = time.perf_counter()
    cost_model = _on_nodes(cost_model, config)
    dens = _densities(samples, densities, estimator)
    ids = np.array([s.id for s in samples], dtype=np.int64)
    lens = np.array([s.num_tokens for s in samples], dtype=np.int64)
    a = _assign(ids, lens, dens, cost_model, config)
    bound = _lower_bound(a.items, a.regime, config)
    if a.cp is not None:
        extra = {**a.extra, "plan_seconds": time.perf_counter() - t0}
        return build_cp_plan(config.strategy, a.cp, a.items, cost_model, config.capacity, a.overlong, extra)
    if "cp_bound" in a.extra:
        bound = a.extra.pop("cp_bound")
    extra = {**a.extra, "plan_seconds": time.perf_counter() - t0}
    return build_plan(config.strategy, a.packs, a.items, a.times, bound, config.capacity, a.overlong, extra)


@dataclass(frozen=True)
class Assignment:
    """A strategy's decision before any :class:`Plan` object is built (what the simulator reads:
    thousands of ranks, where one ``MicroBatch`` per micro-batch would dominate)."""

    packs: list[list[list[int]]]
    """rank -> micro-batch -> item index (into ``items``); empty micro-batches possible."""
    flat: FlatPacks
    """``packs`` as flat arrays, empty micro-batches dropped."""
    items: Items
    times: tuple[np.ndarray, np.ndarray]
    """:func:`~sparsebalance.batching.plan.predict_packs`: ``(B,)`` and ``(R,)`` seconds."""
    regime: Regime
    overlong: dict
    extra: dict
    cp: CPResult | None = None
    """``sab-cp`` when its hybrid plan won (``packs``/``flat``/``times`` are then its
    whole-document part); None otherwise."""


def assign_batch(lengths: np.ndarray, densities: np.ndarray, cost_model: CostModel, config: PlanConfig) -> Assignment:
    """:func:`plan_batch`'s assignment for samples ``0..N-1`` of ``lengths`` (int ``(N,)``, each
    >= 1) and ``densities`` (``(N,)`` in (0, 1]), without building the :class:`Plan`: the same
    packs, items and times as ``plan_batch([Sample(i, n) ...], ..., densities=densities)``."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lens.size == 0:
        raise ValueError("the global batch is empty: nothing to plan")
    if not np.all(lens > 0):
        raise ValueError(f"sample lengths must be >= 1, got {int(lens.min())}")
    dens = np.asarray(densities, dtype=np.float64).reshape(-1)
    if dens.size != lens.size:
        raise ValueError(f"{lens.size} samples but {dens.size} densities")
    if not (np.all(dens > 0) and np.all(dens <= 1.0)):
        raise ValueError("densities must lie in (0, 1]")
    cost_model = _on_nodes(cost_model, config)
    return _assign(np.arange(lens.size, dtype=np.int64), lens, dens, cost_model, config)


def _on_nodes(cost_model, config: PlanConfig):
    """The cost model on ``config.ranks_per_node`` nodes (a ContextCost's links), else as is."""
    if config.ranks_per_node is None or not isinstance(cost_model, ContextCost):
        return cost_model
    return cost_model.on_nodes(config.ranks_per_node)


def _assign(ids, lens, dens, cost_model, config: PlanConfig) -> Assignment:
    _check_size(lens, config)
    items, overlong = _items(ids, lens, dens, cost_model, config)
    regime = Regime(config.micro_batches, config.capacity, float(cost_model.microbatch_overhead()))
    if config.strategy == "sab-cp":
        return _sab_cp(items, regime, cost_model, config, overlong)
    if config.strategy == "sab" and config.pipeline_stages > 1:
        packs, flat, times, extra = sab_pipeline_packs(items, regime, cost_model, config)
    elif config.strategy == "sab":
        packs, flat, times, extra = sab_packs(items, regime, cost_model, config)
    else:
        packs = baseline_packs(config.strategy, items, regime, cost_model, config)
        flat = flatten_packs(packs)
        times, extra = predict_packs(flat, items, cost_model), {}
    return Assignment(packs, flat, items, times, regime, overlong, extra)


def _check_size(lens: np.ndarray, config: PlanConfig) -> None:
    """Refuse, before allocating, a plan this machine cannot hold (items after splitting)."""
    cap = config.capacity
    split = cap is not None and config.overlong == "split"
    num_items = int(np.sum(-(-lens // cap))) if split else int(lens.size)
    check_memory(
        "--world-size / --micro-batches / --capacity",
        f"a plan of {num_items:,} items over {config.world_size:,} ranks",
        plan_bytes(num_items, config.world_size, config.micro_batches),
    )


def _densities(samples, densities, estimator) -> np.ndarray:
    if not samples:
        raise ValueError("the global batch is empty: nothing to plan")
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids):
        raise ValueError("sample ids must be distinct within a global batch")
    if (densities is None) == (estimator is None):
        raise ValueError("give exactly one of densities and estimator")
    d = estimator.estimate(samples) if densities is None else densities
    d = np.asarray(d, dtype=np.float64).reshape(-1)
    if d.size != len(samples):
        raise ValueError(f"{len(samples)} samples but {d.size} densities")
    if not (np.all(d > 0) and np.all(d <= 1.0)):
        raise ValueError("densities must lie in (0, 1]")
    return d


def _items(ids, lens, dens, cost_model, config) -> tuple[Items, dict]:
    """Samples (``(N,)`` ids and lengths) -> items, applying the over-long policy (C only)."""
    offs = np.zeros_like(lens)
    stats = {"num_overlong": 0, "num_split_chunks": 0, "truncated_tokens": 0, "skipped_ids": ()}
    cap = config.capacity
    if cap is not None and config.strategy == "sab-cp":
        k_max = config.cp_degree or config.world_size
        cap = cap * k_max  # a unit of k ranks holds k x C
        # --capacity auto: the memory model's limit (sab-cp refuses any other cost model below)
        memory = cost_model.memory if isinstance(cost_model, ContextCost) else None
        if memory is not None:
            cap = min(cap, memory.max_document(k_max))
    if cap is not None:  # split and truncate fit any C >= 1; skip refuses an empty batch below
        over = lens > cap
        stats["num_overlong"] = int(over.sum())
        if over.any() and config.overlong == "split":
            reps = np.where(over, -(-lens // cap), 1)
            stats["num_split_chunks"] = int(reps[over].sum())
            first = np.repeat(np.cumsum(reps) - reps, reps)
            chunk = np.arange(int(reps.sum())) - first  # chunk index inside its sample
            ids, dens = np.repeat(ids, reps), np.repeat(dens, reps)
            offs = chunk * cap
            lens = np.minimum(np.repeat(lens, reps) - offs, cap)
        elif over.any() and config.overlong == "truncate":
            stats["truncated_tokens"] = int((lens[over] - cap).sum())
            lens = np.minimum(lens, cap)
        elif over.any():  # skip
            stats["skipped_ids"] = tuple(ids[over].tolist())
            ids, lens, offs, dens = ids[~over], lens[~over], offs[~over], dens[~over]
            if ids.size == 0:
                raise ValueError(f"--overlong skip: every sample is longer than --capacity {cap}")
    cost = np.asarray(cost_model.doc_seconds(lens, dens), dtype=np.float64)
    return Items(ids, offs, lens, dens, cost, padded=config.pad_micro_batches), stats


def _lower_bound(items: Items, regime: Regime, config: PlanConfig) -> float:
    """No plan of these items beats this under the additive model (doc seconds + c0 per
    micro-batch): the mean rank load, where every busy rank runs at least one micro-batch and,
    with C, all ranks together at least ``ceil(tokens / C)``; and the largest single item."""
    total, c0, r = float(items.cost.sum()), regime.overhead, config.world_size
    mean = total / r + c0
    if regime.capacity is not None:
        mean = max(mean, (total + c0 * -(-int(items.tokens.sum()) // regime.capacity)) / r)
    return float(max(mean, c0 + items.cost.max()))


def _sab_cp(items: Items, regime: Regime, cost_model, config: PlanConfig, overlong: dict):
    """``sab`` and the best hybrid plan of :func:`~sparsebalance.batching.context.plan_cp`; the
    hybrid one is kept only if predicted strictly faster (or if memory forces splits)."""
    if not isinstance(cost_model, ContextCost):
        raise ValueError(
            "--strategy sab-cp needs a ContextCost (sparsebalance.latency.context) as the cost "
            "model: it prices documents split over k ranks"
        )
    r = config.world_size
    iters = 4 * r + 64 if config.local_search_iters is None else config.local_search_iters
    forced = regime.capacity is not None and bool((items.tokens > regime.capacity).any())
    sab = None
    if not forced:
        sab = sab_packs(items, regime, cost_model, config)
    sab_time = float(sab[2][1].max()) if sab is not None else np.inf
    cp = plan_cp(items, regime, cost_model, r, iters, config.neighbors, sab_time, config.cp_degree)
    if cp is not None and (forced or cp.rank_times.max() < sab_time * (1 - 1e-12)):
        extra = {"local_search_moves": cp.local_search_moves, "candidate": "cp"}
        return Assignment(cp.packs, cp.flat, items, cp.dp_times, regime, overlong, extra, cp)
    packs, flat, times, extra = sab
    extra = {**extra, "candidate": f"sab/{extra['candidate']}"}
    if cp is not None:
        extra["cp_bound"] = cp.lower_bound
    return Assignment(packs, flat, items, times, regime, overlong, extra)
