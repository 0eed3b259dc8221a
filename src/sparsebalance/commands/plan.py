"""``sparsebalance plan``: pack a global batch into ranks x micro-batches with every strategy (or
one) and compare predicted step times, balance efficiency and the lower bound.

Input (``--lengths FILE``, read by :func:`sparsebalance.data.read_lengths`): one length per line
(``#`` comments allowed); or JSON, either a list of lengths or an object with a ``lengths`` list
(optional ``densities`` and ``sources`` lists of the same size); or a jsonl dataset, one object
per line, whose ``--text-field`` is tokenized with a whitespace tokenizer (token =
whitespace-separated word; the model's tokenizer comes with the trainer), with optional
``density`` and ``source`` fields.

Densities: those given in the file, else what the budget keeps before any measurement: under
``--budget top-k`` (the default) each document's density at the base k (``--budget-tokens`` /
the profile's block size; the paper's per-length-bin estimate starts there), under ``--budget
gamma`` the history estimator's prior.
Cost model: a :class:`~sparsebalance.latency.LatencyModel` from ``--profile P`` (made by
``sparsebalance profile``), else from the analytic FLOP-count profile of ``--model`` (default:
the built-in ``tiny``) on ``--accelerator``. The model used is printed.

``--capacity auto``: C is the largest micro-batch whose peak the memory model
(:mod:`sparsebalance.latency.memory`, analytic coefficients of ``--accelerator`` for ``--model``)
predicts within ``--memory-budget`` (default: 90% of the accelerator's memory), with the run's
``--activation-checkpointing``, ``--loss`` and ``--parallel`` (fsdp2 shards the weights, gradients
and optimizer state over R ranks). ``sab-cp`` then also takes each long document's minimum CP
degree from the memory model (which counts the ring's buffer and the document's layout metadata
beyond ``ceil(L / C)``), and documents that fit on no R ranks follow ``--overlong``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from ..batching import (
    DEFAULT_CAPACITY,
    OVERLONG,
    STRATEGIES,
    HistoryEstimator,
    PlanConfig,
    make_estimator,
    plan_batch,
)
from ..data import read_lengths
from ..engine.parallelize import FSDP_GRADIENT_SYNC
from ..files import check_output_file, write_text_atomic
from ..latency import ACCELERATORS, context_cost, load_cost_model, load_profile
from ..latency.host_memory import parse_bytes
from ..latency.memory import ANALYTIC, CHECKPOINTING, GIB, MemoryConfig, MemoryModel
from ..latency.memory_bound import MemoryBound, with_budget_fraction
from ..models import load_shapes
from ..results import markdown_table
from ..tuning import DSTConfig
from ..tuning.config import DEFAULT_BUDGET_TOKENS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lengths",
        default=None,
        metavar="FILE",
        help="lengths / JSON / jsonl file (default: the first global batch train draws from its built-in data)",
    )
    p.add_argument("--world-size", type=int, default=2, metavar="R", help="ranks (default: 2, train's on a CPU)")
    _add_capacity_arguments(p)
    _add_cost_arguments(p)
    p.add_argument("--strategy", default="all", help=f"one of {', '.join(STRATEGIES)}, or all")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        metavar="G",
        help="ranks sharing a node: sab-cp keeps units of <= G ranks inside one node "
        "(default: the links' node size, 8 for an analytic accelerator)",
    )
    p.add_argument("--overlong", choices=OVERLONG, default="split", help="documents longer than C")
    _add_budget_arguments(p)
    p.add_argument("--text-field", default="text", help="jsonl field to tokenize")
    p.add_argument("--seed", type=int, default=None, help="shuffle the file order with this seed")
    p.add_argument("--save", metavar="PATH", help="write every plan (with assignment) as JSON")
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")


def _add_capacity_arguments(p: argparse.ArgumentParser) -> None:
    """The per-rank bound: --micro-batches M or --capacity C (auto: the memory model's, from the run's settings)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--micro-batches", type=int, metavar="M", help="micro-batches per rank")
    group.add_argument(
        "--capacity",
        metavar="C",
        help="tokens per micro-batch, or auto (the memory model's largest within --memory-budget); "
        f"default: {DEFAULT_CAPACITY}, train's, unless --micro-batches is given",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        help="--capacity auto: bytes per device, e.g. 72GB (default: 90%% of --accelerator's)",
    )
    p.add_argument(
        "--activation-checkpointing",
        choices=CHECKPOINTING,
        default="off",
        help="--capacity auto: the run's checkpointing",
    )
    p.add_argument("--loss", choices=["chunked", "plain"], default="chunked", help="--capacity auto: the run's loss")
    p.add_argument(
        "--parallel",
        choices=["ddp", "fsdp2"],
        default="ddp",
        help="--capacity auto: fsdp2 shards weights, optimizer over R",
    )
    p.add_argument(
        "--fsdp-gradient-sync",
        choices=FSDP_GRADIENT_SYNC,
        default="micro-batch",
        help="--capacity auto with fsdp2, as train's: reduce-scatter after every micro-batch (a later one "
        "holds 1/R of the gradients) or in the step's last only (it holds them whole)",
    )


def _add_cost_arguments(p: argparse.ArgumentParser) -> None:
    """The latency model: a measured profile, else the analytic one of --model on --accelerator."""
    p.add_argument("--profile", metavar="P", help="latency profile (default: analytic profile)")
    p.add_argument("--model", default="tiny", help="model for the analytic profile")
    p.add_argument(
        "--accelerator",
        choices=sorted(ACCELERATORS),
        default="h100",
        help="accelerator for the analytic profile",
    )


def _add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """The sparse budget the densities are estimated for."""
    p.add_argument(
        "--budget",
        choices=("top-k", "gamma"),
        default="top-k",
        help="the budget kind the densities are estimated for",
    )
    p.add_argument(
        "--budget-tokens",
        type=int,
        default=DEFAULT_BUDGET_TOKENS,
        help=f"top-k: the base budget in tokens attended (default: {DEFAULT_BUDGET_TOKENS}, the paper's)",
    )


def main(args: argparse.Namespace) -> int:
    configs, capacity, memory = _plan_configs(args)
    samples, densities = _read_samples(args)
    cost_model, cost_name = _cost_model(args, memory)
    source, kwargs = _density_source(args, densities, cost_model)
    plans = [plan_batch(samples, cost_model, cfg, **kwargs) for cfg in configs]
    result = {
        "num_samples": len(samples),
        "num_tokens": int(sum(s.num_tokens for s in samples)),
        "world_size": args.world_size,
        "micro_batches": args.micro_batches,
        "capacity": capacity,
        "capacity_source": "memory model" if memory is not None else "given",
        "overlong": args.overlong,
        "cost_model": cost_name,
        "densities": source,
        "strategies": {p.strategy: p.summary() for p in plans},
    }
    if args.save:
        full = {**result, "strategies": {p.strategy: p.to_dict() for p in plans}}
        write_text_atomic(args.save, json.dumps(full) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_plans(args, result, plans, memory)
    return 0


def _plan_configs(args) -> tuple[list[PlanConfig], int | None, MemoryBound | None]:
    """One :class:`PlanConfig` per strategy asked for, and the capacity (with its memory bound),
    all validated before any file is read; ``--save`` is checked before planning too."""
    if args.strategy != "all" and args.strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)} or all, got {args.strategy!r}")
    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
    if args.save:  # before planning: the plans are never lost to an output error
        check_output_file(args.save, "--save")
    capacity, memory = _capacity(args)
    shared = {
        "micro_batches": args.micro_batches,
        "capacity": capacity,
        "overlong": args.overlong,
        "ranks_per_node": args.ranks_per_node,
    }
    configs = [
        PlanConfig(args.world_size, strategy=s, **shared) for s in strategies
    ]  # validates R, M, C before any file is read
    return configs, capacity, memory


def _read_samples(args) -> tuple[list, np.ndarray | None]:
    """The samples of ``--lengths`` (and their densities, if the file has them), shuffled with
    ``--seed``; without it, the first global batch ``train`` draws from its built-in data."""
    if args.lengths is None:
        return builtin_batch(), None
    samples, densities = read_lengths(args.lengths, args.text_field)
    if args.seed is not None:
        order = np.random.default_rng(args.seed).permutation(len(samples))
        samples = [samples[i] for i in order]
        densities = None if densities is None else densities[order]
    return samples, densities


def builtin_batch() -> list:
    """What ``sparsebalance train`` with its defaults trains first: the first global batch of its
    built-in synthetic data, drawn as its data order draws it (seed, sizes: its defaults)."""
    from ..data import load_corpus, load_tokenizer
    from ..data.batches import BatchSource
    from ..train.config import TrainConfig

    d = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    corpus = load_corpus(None, load_tokenizer(d["tokenizer"]), d["text_field"], d["num_builtin"], d["seed"], None, None)
    return BatchSource(corpus, d["seed"], d["global_batch"]).next_batch()


def _cost_model(args, memory: MemoryBound | None):
    """The context-aware cost model and its one-line description (profile, links, node size)."""
    cost_model, cost_name = load_cost_model(args.profile, args.model, args.accelerator)
    # sab-cp prices split documents with link speeds (the profile's measured ones, else the
    # analytic --accelerator's); every other strategy sees the plain latency model through it.
    cost_model = context_cost(cost_model, args.accelerator, memory=memory)
    g = args.ranks_per_node or cost_model.links.ranks_per_node
    nodes = f"{g} ranks per node" if g < args.world_size else "one node"
    cost_name += f"; links {cost_model.links.source}, {nodes}"
    return cost_model, cost_name


def _density_source(args, densities, cost_model) -> tuple[str, dict]:
    """Where the densities come from (the file's, the gamma prior, top-k's estimator) and the
    ``plan_batch`` keyword that supplies them."""
    if densities is not None:
        return "file", {"densities": densities}
    if args.budget == "gamma":
        return "HistoryEstimator prior", {"estimator": HistoryEstimator()}
    if args.budget_tokens < 0:
        raise ValueError(f"--budget-tokens must be >= 0, got {args.budget_tokens}")
    block = int(cost_model.base.profile.fingerprint.get("block_size", 128))
    knob = DSTConfig(budget_tokens=args.budget_tokens).knob(block)
    source = f"top-k {args.budget_tokens} tokens (k {knob.base} at block {block})"
    return source, {"estimator": make_estimator("ema", knob)}


def _print_plans(args, result: dict, plans: list, memory: MemoryBound | None) -> None:
    """The human-readable report: the bound, the cost model, the table, what --overlong did."""
    capacity = result["capacity"]
    bound = f"M = {args.micro_batches}" if capacity is None else f"C = {capacity}"
    if memory is not None:
        peak = memory.model.peak_bytes(capacity, memory.config)
        bound += (
            f" (--capacity auto: predicted peak {peak / GIB:.2f} of "
            f"{memory.budget_bytes / GIB:.2f} GiB, {memory.model.c.name})"
        )
    lengths = args.lengths or "train's first global batch of its built-in data"
    print(
        f"{result['num_samples']} samples ({lengths}), {result['num_tokens']} tokens, R = {args.world_size}, {bound}\n"
        f"cost model: {result['cost_model']}; densities: {result['densities']}\n"
    )
    print(format_table(plans))
    for line in overlong_lines(plans, args.world_size, args.overlong):
        print(line)
    if args.save:
        print(f"\nwrote {args.save}")


def _capacity(args) -> tuple[int | None, MemoryBound | None]:
    """``--capacity`` as a token count, or ``auto``'s: (C, the memory bound it came from)."""
    if args.capacity is None:  # --micro-batches M, or train's default capacity
        return (DEFAULT_CAPACITY if args.micro_batches is None else None), None
    if str(args.capacity) != "auto":
        try:
            return int(args.capacity), None
        except ValueError:
            raise ValueError(f"--capacity must be a token count or auto, got {args.capacity!r}") from None
    coeffs = ANALYTIC[args.accelerator]
    budget = parse_bytes(args.memory_budget) if args.memory_budget else with_budget_fraction(coeffs)
    shard = args.world_size if args.parallel == "fsdp2" else 1
    block = 128  # the analytic profile's; a measured --profile's own
    if args.profile:
        block = int(load_profile(args.profile).fingerprint.get("block_size", block))
    # a rank may run several micro-batches: later backwards hold the accumulated gradients
    # (sharded: train's FSDP2 reduce-scatters every micro-batch by default)
    cfg = MemoryConfig(
        args.activation_checkpointing,
        args.loss,
        shard=max(1, shard),
        micro_batches=2,
        reduce_every=args.parallel == "fsdp2" and args.fsdp_gradient_sync == "micro-batch",
        block_size=block,
    )
    memory = MemoryBound(MemoryModel(load_shapes(args.model), coeffs), budget, cfg)
    return memory.capacity(), memory


def overlong_lines(plans: list, world_size: int, policy: str) -> list[str]:
    """What ``--overlong`` did, per limit: ``sab-cp``'s is a unit of R ranks (R x C tokens, or
    the memory model's longest document on R ranks), the other strategies' is C; the strategies
    are named when the counts differ between them."""
    groups: dict[tuple[int, bool], list[str]] = {}
    for p in plans:
        if p.metrics.num_overlong:
            key = (p.metrics.num_overlong, p.strategy == "sab-cp")
            groups.setdefault(key, []).append(p.strategy)
    lines = []
    for (n, cp), names in groups.items():
        limit = f"a unit of R = {world_size} ranks" if cp else "C"
        which = f" ({', '.join(names)})" if len(names) < len(plans) else ""
        lines.append(f"\n{n} documents longer than {limit}{which}: --overlong {policy}")
    return lines


def format_table(plans: list) -> str:
    """One row per strategy; times in milliseconds."""
    headers = [
        "strategy",
        "max ms",
        "mean ms",
        "lower bound ms",
        "efficiency",
        "gap to bound",
        "micro-batches",
        "capacity waste",
        "split docs",
        "CP degrees",
        "comm ms",
        "plan ms",
        "hash",
    ]
    rows = [
        [
            p.strategy,
            p.metrics.max_time * 1e3,
            p.metrics.mean_time * 1e3,
            p.metrics.lower_bound * 1e3,
            p.metrics.efficiency,
            p.metrics.gap_to_bound,
            p.metrics.num_microbatches,
            p.metrics.capacity_waste,
            p.metrics.num_split_documents,
            _degrees(p.metrics.cp_degrees),
            p.metrics.comm_seconds * 1e3,
            p.metrics.plan_seconds * 1e3,
            p.hash(),
        ]
        for p in plans
    ]
    return markdown_table(headers, rows)


def _degrees(degrees: tuple[int, ...]) -> str:
    """``(4, 4, 2)`` -> ``"4x2, 2x1"`` (degree x count); ``-`` when nothing is split."""
    if not degrees:
        return "-"
    counts: dict[int, int] = {}
    for k in degrees:
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{k}x{n}" for k, n in counts.items())
