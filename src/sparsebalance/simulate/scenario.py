"""A simulated cluster: where batches, densities, costs and the per-step overhead come from.

:class:`SimConfig` holds the command's settings; :func:`run_simulation` draws the global batches
(seeded per ``(seed, world size, step)``, so every strategy sees the same samples and results do
not depend on ``--workers``), builds the cost model and calls
:func:`~sparsebalance.simulate.engine.simulate_steps` once per world size.

Cost model: a measured profile (``--profile``) or the analytic FLOP-count profile of ``--model`` on
``--analytic h100|h200`` at ``--efficiency`` (a stated approximation, see
:mod:`sparsebalance.latency.analytic`). The per-step overhead is the optimizer step from the profile
plus a ring all-reduce of bf16 gradients at each world size (``allreduce_seconds``: NVLink inside
8-GPU nodes, or ``--ranks-per-node``, InfiniBand across them), not overlapped with compute.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np

from .. import flags
from ..batching import DEFAULT_CAPACITY
from ..batching.interleaved import check_virtual
from ..batching.pipeline import check_weight_share
from ..batching.schedule import balanced_layers, head_layers, stage_layers
from ..batching.zero_bubble import WEIGHT_SHARE, check_schedule
from ..latency import (
    ACCELERATORS,
    LatencyModel,
    allreduce_seconds,
    analytic_profile,
    context_cost,
    load_profile,
)
from ..latency.context import RING_KINDS
from ..latency.profile import Profile, shape_differences
from ..models import ModelShapes, load_shapes
from ..ops.flex_config import resolve_block_size
from ..sizes import SIM_BYTES_PER_DOCUMENT, check_memory, plan_bytes
from ..tuning import DensityCurve, DSTConfig
from .distributions import LengthDistribution
from .engine import DEFAULT_STRATEGIES, StepBatch, resolve_strategies, simulate_steps
from .sparsity import SparsityModel


@dataclass(frozen=True)
class SimConfig:
    """Settings of ``sparsebalance simulate`` (validated on construction). Flags and TOML keys
    are generated from the fields (:mod:`sparsebalance.flags`): ``--steps``,
    ``--lengths.max-len``, ``--dst.gamma-min``; the short aliases in brackets."""

    world_sizes: tuple[int, ...] = (8,)
    """[--world-size] data-parallel ranks R, one simulation per value (each >= 1)."""
    micro_batches: int | None = None
    """[--micro-batches] micro-batches per rank M; exactly one of this and ``capacity``."""
    capacity: int | None = None
    """[--capacity] token capacity per micro-batch C (default: train's, 4096, unless
    --micro-batches is given)."""
    samples_per_rank: int = 8
    """[--samples-per-rank] documents per rank per step: the global batch is R x this (>= 1)."""
    steps: int = 20
    """[--steps] global batches replayed (>= 1)."""
    seed: int = 0
    """[--seed] seeds every batch (per world size and step)."""
    lengths: LengthDistribution = field(default_factory=LengthDistribution)
    """Document lengths: a built-in shape (``--dist``, ``--min-len``, ``--max-len``) or a file
    (``--lengths FILE``, read by the command)."""
    sparsity: SparsityModel = field(default_factory=SparsityModel)
    """Densities at gamma0 (``--density-at-4k``, ``--density-slope``, ``--density-noise``); its
    floor counts blocks of ``block_size``."""
    dst: DSTConfig = field(default_factory=DSTConfig)
    """DST flags (``--dst.FIELD`` / ``--budget-tokens`` ...): mode and anchor are set per
    strategy; the budget, p and the bounds apply to all."""
    curve_alpha: tuple[float, float] = (1.0, 1.0)
    """[--curve-alpha] LOW,HIGH: the density-response exponents below / above gamma0."""
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    """[--strategy] ablations to run (baseline is always added)."""
    profile: str | None = None
    """[--profile] a measured latency profile; else the analytic one."""
    analytic: str = "h100"
    """[--analytic] accelerator of the analytic profile (and of the all-reduce model)."""
    model: str | None = None
    """[--model] model shapes (built-in name or config.json path) of the analytic profile, default
    qwen2.5-0.5b; with --profile, the model the profile was made for (it prices no other)."""
    efficiency: float = 0.45
    """[--efficiency] fraction of peak FLOP/s reached by dense GEMMs (analytic profile)."""
    attention_efficiency: float = 0.35
    """[--attention-efficiency] fraction of peak reached by block-sparse attention."""
    block_size: int | None = None
    """[--block-size] sparse-attention block size (analytic profile and density floor); default:
    the simulated GPU's, 128 on CUDA (resolved on construction)."""
    ring: str = "auto"
    """[--ring] ring of split documents (``sab-cp``): ``auto`` (hierarchical once a unit spans
    nodes and k is a multiple of the node size), ``flat`` or ``hierarchical``."""
    ranks_per_node: int | None = None
    """[--ranks-per-node] ranks sharing a node G: ``sab-cp`` keeps a unit of k <= G ranks inside
    one node (in-node link), wider units cross nodes (hierarchical ring, inner ring = a node);
    the gradient all-reduce uses the in-node link up to G ranks. Default: the accelerator's 8
    GPUs per node (measured profile links: one host)."""
    pipeline_stages: int = 1
    """[--pp] pipeline stages P per data-parallel rank: each rank becomes a pipeline of P
    devices (1F1B, or --pp-schedule's) (R x P in all), its time the pipeline's makespan, bubbles included
    (:mod:`sparsebalance.simulate.pipeline`); at most the model's layers. 1 = no pipeline."""
    pipeline_virtual: int = 1
    """[--pp-virtual] chunks of layers per pipeline device V: interleaved 1F1B
    (:mod:`sparsebalance.batching.interleaved`), each device holding V non-adjacent chunks; needs
    --pp >= 2 and at least --pp x V layers. 1 = plain 1F1B."""
    pipeline_schedule: str = "1f1b"
    """[--pp-schedule] the pipeline schedule: 1f1b (interleaved with --pp-virtual), or zb-h1, zero
    bubble (:mod:`sparsebalance.batching.zero_bubble`: each stage's backward split into the
    input's gradient and the weights', which fill the bubbles); sab, DST and the step's pricing
    all read its makespan. zb-h1 needs --pp >= 2 and --pp-virtual 1."""
    pipeline_weight_share: float = WEIGHT_SHARE
    """[--pp-weight-share] zb-h1: the weights' gradient's share of a stage's backward, in [0, 1)
    (a training run measures it; default 1/3, an estimate). Read only with --pp-schedule zb-h1."""
    pad_micro_batches: bool = False
    """[--pad-micro-batches] run every micro-batch unpacked, its documents padded to its longest
    (Megatron-style ``(K, S)`` batches; the SparseBalance paper's micro-batch 2 as we read it),
    in every strategy: a model of frameworks that pad (the trainer packs). Needs
    ``--micro-batches`` (:mod:`sparsebalance.batching.padding`)."""
    show_step: int = 0
    """[--show-step] the step whose per-rank times are kept (for the plot)."""
    workers: int = 1
    """[--workers] processes over steps (results are identical for any value)."""

    def __post_init__(self) -> None:
        flags.check_fields(self)  # types first (the Python API): one line naming the field
        # every simulated accelerator is a CUDA GPU: its block, priced and never compiled here
        object.__setattr__(self, "block_size", resolve_block_size("cuda", self.block_size, backend=None))
        if self.ring not in RING_KINDS:
            raise ValueError(f"--ring must be one of {', '.join(RING_KINDS)}, got {self.ring!r}")
        if not self.world_sizes:
            raise ValueError("--world-size needs at least one value")
        for r in self.world_sizes:
            if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
                raise ValueError(f"--world-size values must be integers >= 1, got {r!r}")
        if self.micro_batches is None and self.capacity is None:  # train's default bound
            object.__setattr__(self, "capacity", DEFAULT_CAPACITY)
        if self.micro_batches is not None and self.capacity is not None:
            raise ValueError("give one of --micro-batches M and --capacity C, not both")
        for flag, v in (("--micro-batches", self.micro_batches), ("--capacity", self.capacity)):
            if v is not None and v <= 0:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        for flag, v in (("--samples-per-rank", self.samples_per_rank), ("--steps", self.steps)):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        if self.analytic not in ACCELERATORS:
            raise ValueError(f"--analytic must be one of {', '.join(ACCELERATORS)}")
        for flag, v in (("--efficiency", self.efficiency), ("--attention-efficiency", self.attention_efficiency)):
            if not (math.isfinite(v) and 0.0 < v <= 1.0):
                raise ValueError(f"{flag} must be in (0, 1], got {v}")
        if not 0 <= self.show_step < self.steps:
            raise ValueError(f"--show-step must be in [0, --steps={self.steps}), got {self.show_step}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.pipeline_stages < 1:
            raise ValueError(f"--pp must be >= 1, got {self.pipeline_stages}")
        check_virtual(self.pipeline_stages, self.pipeline_virtual)
        check_schedule(self.pipeline_schedule, self.pipeline_stages, self.pipeline_virtual)
        check_weight_share(self.pipeline_weight_share, "--pp-weight-share")
        if self.pad_micro_batches and self.micro_batches is None:
            raise ValueError(
                "--pad-micro-batches needs --micro-batches M (not --capacity): a padded micro-batch has K documents"
            )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node must be >= 1, got {self.ranks_per_node}")
        resolve_strategies(self.strategies)  # unknown names fail before any work
        DensityCurve(self.dst.gamma0, *self.curve_alpha)

    @property
    def curve(self) -> DensityCurve:
        return DensityCurve(self.dst.gamma0, *self.curve_alpha)


def draw_batches(config: SimConfig, world_size: int) -> list[StepBatch]:
    """The global batches of one world size: ``steps`` x ``R * samples_per_rank`` documents."""
    n = world_size * config.samples_per_rank
    out = []
    for step in range(config.steps):
        rng = np.random.default_rng([config.seed, world_size, step])
        lengths, dens = config.lengths.sample(rng, n)
        if dens is None:
            dens = config.sparsity.sample(rng, lengths, config.block_size)
        out.append(StepBatch(lengths, dens))
    return out


DEFAULT_MODEL = "qwen2.5-0.5b"
"""The analytic profile's model when ``--model`` is not given."""


def cost_inputs(config: SimConfig) -> tuple[Profile | None, ModelShapes | None]:
    """The measured profile (or None: analytic) and the model shapes the simulation prices,
    checked before anything is simulated: ``--model`` must be a supported model, and with
    ``--profile`` the model the profile was made for (a profile prices no other model's layers;
    ``ValueError`` naming both). Shapes are None for a profile that keeps none and no
    ``--model``: the all-reduce is then left out."""
    shapes = None if config.model is None else load_shapes(config.model)
    if config.profile is None:
        return None, shapes or load_shapes(DEFAULT_MODEL)
    profile = load_profile(config.profile)
    if shapes is not None:
        diffs = shape_differences(profile, shapes)
        if diffs:
            model = flags.name(config, "model")
            raise ValueError(
                f"{flags.name(config, 'profile')} {config.profile} was made for another model "
                f"than {model} {config.model} (profile vs model: {'; '.join(diffs)}): leave "
                f"{model} out (the profile prices its own model), or make a profile of "
                f"{config.model} with `sparsebalance profile --model {config.model}`"
            )
        return profile, shapes
    kept = profile.fingerprint.get("shapes")
    return profile, ModelShapes(name="profile", **kept) if isinstance(kept, dict) else None


def build_cost_model(config: SimConfig) -> tuple[LatencyModel, ModelShapes | None, str]:
    """The latency model, the shapes it prices (for the all-reduce) and a one-line description."""
    profile, shapes = cost_inputs(config)
    if profile is not None:
        return LatencyModel(profile), shapes, f"profile {config.profile}"
    # The analytic grid spans 2 x max_context tokens: widen it to the largest possible pack so
    # no prediction leaves the table (the analytic form is the same function either way).
    per_rank = config.lengths.longest * config.samples_per_rank
    grid_shapes = replace(shapes, max_context=max(shapes.max_context, per_rank // 2 + 1))
    profile = analytic_profile(
        grid_shapes,
        config.analytic,
        config.efficiency,
        config.attention_efficiency,
        block_size=config.block_size,
    )
    desc = (
        f"analytic {shapes.name} on {config.analytic} (GEMM efficiency {config.efficiency:g}, "
        f"attention {config.attention_efficiency:g}, block {config.block_size})"
    )
    return LatencyModel(profile), shapes, desc


def step_overhead(model: LatencyModel, shapes: ModelShapes | None, config: SimConfig, r: int):
    """Optimizer seconds (from the profile) + bf16 gradient ring all-reduce at ``r`` ranks. With
    ``--pp P`` each stage updates and all-reduces (over its ``r`` data-parallel peers) about 1/P
    of the parameters, in parallel: both terms are divided by P."""
    pp = config.pipeline_stages
    if shapes is None:
        return model.profile.optimizer_seconds / pp
    params = (shapes.layer_params() * shapes.num_layers + shapes.vocab_size * shapes.hidden_size) / pp
    acc = ACCELERATORS[config.analytic]
    if config.ranks_per_node is not None:
        acc = replace(acc, gpus_per_node=config.ranks_per_node)
    comm = allreduce_seconds(2 * params, r, acc)
    return model.profile.optimizer_seconds / pp + comm


def run_simulation(config: SimConfig) -> dict:
    """Every world size of ``config``: JSON-ready results plus what was assumed."""
    for r in config.world_sizes:  # refuse what cannot fit before simulating anything
        n = r * config.samples_per_rank
        check_memory(
            "--world-size / --samples-per-rank / --steps",
            f"R = {r:,}: {config.steps:,} steps of {n:,} documents",
            SIM_BYTES_PER_DOCUMENT * n * config.steps + plan_bytes(n, r, config.micro_batches),
        )
    model, shapes, desc = build_cost_model(config)
    check_virtual(config.pipeline_stages, config.pipeline_virtual, model.num_layers)  # before the split
    # Every planner sees the latency model through a ContextCost (sab-cp also prices split
    # documents with its links; the others read only the base model's numbers).
    cost = context_cost(model, config.analytic, shapes, ring=config.ring, block_size=config.block_size)
    if config.ranks_per_node is not None:
        cost = cost.on_nodes(config.ranks_per_node)
    g = cost.links.ranks_per_node
    nodes = f"{g} ranks per node" if g < max(config.world_sizes) else "one node"
    desc += f"; CP links {cost.links.source}, {nodes}, ring {config.ring}"
    results = []
    for r in config.world_sizes:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            if config.profile is None:
                # The analytic profile is linear in density and its fit is the same FLOP count
                # outside the grid: leaving the grid (densities < 0.02 after cuts) is not an error.
                warnings.filterwarnings("ignore", message="latency model: some inputs lie outside")
            res = _simulate_one(config, model, cost, shapes, r)
        res["wall_seconds"] = time.perf_counter() - t0
        results.append(res)
    out = _describe(config, desc, results)
    if config.pipeline_stages > 1:
        stages = config.pipeline_stages * config.pipeline_virtual  # per virtual stage when interleaved
        split = pipeline_split(shapes, model.num_layers, stages)
        out["stage_layers"] = list(split) or stage_layers(model.num_layers, stages).tolist()
    return out


def _simulate_one(config: SimConfig, model: LatencyModel, cost, shapes, r: int) -> dict:
    return simulate_steps(
        draw_batches(config, r),
        r,
        cost,
        micro_batches=config.micro_batches,
        capacity=config.capacity,
        strategies=config.strategies,
        dst=config.dst,
        curve=config.curve,
        block_size=config.block_size,
        step_overhead=step_overhead(model, shapes, config, r),
        show_step=config.show_step,
        workers=config.workers,
        pipeline_stages=config.pipeline_stages,
        stage_layers=pipeline_split(shapes, model.num_layers, config.pipeline_stages * config.pipeline_virtual),
        pad_micro_batches=config.pad_micro_batches,
        pipeline_virtual=config.pipeline_virtual,
        pipeline_schedule=config.pipeline_schedule,
        weight_share=config.pipeline_weight_share,
    )


def pipeline_split(shapes: ModelShapes | None, num_layers: int, num_stages: int) -> tuple[int, ...]:
    """The trainer's layers per stage for ``--pp P`` (:func:`~sparsebalance.batching.schedule.
    balanced_layers`, the LM head weighed from the model's shapes); without shapes (a measured
    profile alone) or a pipeline: empty, the even split."""
    if shapes is None or num_stages == 1:
        return ()
    return tuple(balanced_layers(num_layers, num_stages, head_layers(shapes)).tolist())


def _describe(config: SimConfig, desc: str, results: list[dict]) -> dict:
    return {
        "cost_model": desc,
        "lengths": config.lengths.describe(),
        "sparsity": (
            "measured densities from the lengths file"
            if config.lengths.densities is not None
            else config.sparsity.describe(config.block_size)
        ),
        "curve": {
            "gamma0": config.dst.gamma0,
            "alpha_low": config.curve_alpha[0],
            "alpha_high": config.curve_alpha[1],
        },
        "dst": {
            "budget": config.dst.budget,
            **(
                {
                    "budget_tokens": config.dst.budget_tokens,
                    "budget_tokens_min": config.dst.budget_tokens_min,
                    "budget_tokens_max": config.dst.budget_tokens_max,
                }
                if config.dst.budget == "top-k"
                else {
                    "gamma0": config.dst.gamma0,
                    "gamma_min": config.dst.gamma_min,
                    "gamma_max": config.dst.gamma_max,
                }
            ),
            "p": config.dst.p,
            "tolerance": config.dst.tolerance,
            "raise_to": config.dst.raise_to,
            "anchor": config.dst.anchor,
        },
        "micro_batches": config.micro_batches,
        "capacity": config.capacity,
        "samples_per_rank": config.samples_per_rank,
        "steps": config.steps,
        "seed": config.seed,
        **({"pipeline_stages": config.pipeline_stages} if config.pipeline_stages > 1 else {}),
        **({"pipeline_virtual": config.pipeline_virtual} if config.pipeline_virtual > 1 else {}),
        **(
            {"pipeline_schedule": config.pipeline_schedule, "weight_share": config.pipeline_weight_share}
            if config.pipeline_schedule != "1f1b"
            else {}
        ),
        **({"pad_micro_batches": True} if config.pad_micro_batches else {}),
        "results": results,
    }
