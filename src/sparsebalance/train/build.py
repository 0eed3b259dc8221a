"""The parts of a ``sparsebalance train`` run, each built by one function for
:class:`~.trainer.Trainer`: the world's checks, the data (resolved once per node), the model,
``--capacity auto``'s memory bound, the run folder's checks and its files."""

from __future__ import annotations

import json
import shutil
import sys
import weakref
from dataclasses import replace
from pathlib import Path

import torch

from .. import flags
from ..batching.interleaved import HELD_LIMIT, held_stages
from ..batching.schedule import balanced_layers, head_layers
from ..batching.zero_bubble import pending_weights
from ..data import load_tokenizer
from ..data.dataset import TokenizedCorpus, apply_vocabulary, compact_vocabulary, open_corpus, resolve_data
from ..data.store import is_store
from ..engine.runtime import Runtime
from ..engine.stage import PipelineLayout, StageModel, check_pipeline_model
from ..latency import LatencyModel, fingerprint, load_profile
from ..latency.host_memory import parse_bytes
from ..latency.memory import GIB, MemoryConfig, MemoryModel, StageShare, device_coefficients
from ..latency.memory_bound import MemoryBound, auto_capacity, with_budget_fraction
from ..latency.memory_fit import find_calibration, memory_fingerprint
from ..models import ModelShapes, check_attention, check_trainable
from ..models.checkpointing import apply_activation_checkpointing
from ..models.head import tied_head
from ..models.hf import build_model
from ..precision import resolve_precision
from .checkpoint import clean_temporaries
from .config import RUN_FILES, TrainConfig, check_pipeline_world, earlier_run, resolve_strategy
from .config_io import to_record
from .multinode import Topology, node_leaders, resolve_on_nodes
from .stage_init import InitLog, build_on_meta, load_stage_weights, materialise


def say(rt: Runtime, line: str) -> None:
    """One ``sparsebalance train:`` line on stderr, from rank 0."""
    if rt.is_main:
        print(f"sparsebalance train: {line}", file=sys.stderr, flush=True)


def check_world(cfg: TrainConfig, rt: Runtime) -> tuple[TrainConfig, int]:
    """The config with ``--strategy auto`` resolved for this world, and its number of ranks
    (``--emulate-ranks``, else the processes, a pipeline's ``--pp`` stages counting as one);
    refuses a world the settings cannot split."""
    if cfg.emulate_ranks and rt.distributed:
        raise ValueError("--emulate-ranks runs in one process: launch it with --nproc 1")
    check_pipeline_world(cfg, rt.world_size)
    num_ranks = cfg.emulate_ranks or rt.world_size // cfg.pp  # a pipeline is one planned rank
    cfg = resolve_strategy(cfg, num_ranks)  # --strategy auto
    if cfg.cp is not None and num_ranks % cfg.cp:
        raise ValueError(
            f"--cp {cfg.cp} must divide the world size ({num_ranks}): the ranks form world / K context-parallel groups"
        )
    return cfg, num_ranks


def topology(cfg: TrainConfig, rt: Runtime, num_ranks: int, placements: list) -> Topology:
    """Which ranks share a node: ``--ranks-per-node``, else the launcher's (checked to agree
    on every rank), else one node. Emulated ranks have no launcher."""
    if cfg.pp > 1:  # the planned ranks are pipelines; only sab-cp reads the nodes, and it cannot pipeline
        return Topology(num_ranks, num_ranks)
    reported = [] if cfg.emulate_ranks else placements
    found, note = Topology.from_launcher(num_ranks, reported, cfg.ranks_per_node)
    if note:
        say(rt, f"note: {note}")
    return found


def open_data(cfg: TrainConfig, rt: Runtime, placements: list) -> TokenizedCorpus:
    """``--data`` as one corpus. Rank 0 resolves it (preparing raw inputs into the cache once)
    while the others wait; every rank then maps rank 0's stores. A node that cannot see them
    (its own cache) uses the stores its first rank (``LOCAL_RANK`` 0) resolves alone
    (:func:`resolve_on_nodes`): one writer per node-local cache."""
    tokenizer = load_tokenizer(cfg.tokenizer)

    def resolve():
        return resolve_data(
            cfg.data,
            tokenizer,
            cfg.text_field,
            cfg.num_builtin,
            cfg.seed,
            cfg.min_len,
            cfg.max_len,
            on_bad_record=cfg.on_bad_record,
            progress=rt.is_main,
        )

    def usable(sources) -> bool:
        return all(is_store(s.store) for s in sources)

    sources = resolve_on_nodes(resolve, usable, rt.rank, node_leaders(placements), rt.all_gather_object)
    return open_corpus(sources, cfg.min_len, cfg.max_len)


def check_model(cfg: TrainConfig) -> str:
    """Refuse, in one line and before the data is prepared, a ``--model`` whose type or attention
    cannot train here; returns how the setting was given (``--model M`` or ``model='M'``)."""
    named = flags.given(cfg, "model", cfg.model)
    check_trainable(cfg.model, named)
    return named


def checked_model(cfg: TrainConfig, device: torch.device, named: str) -> torch.nn.Module:
    """``--model`` built in fp32 master weights on ``device`` (its attention checked as built:
    defaults the file left out), with ``--activation-checkpointing`` applied; ``named``: what
    :func:`check_model` returned. With ``--pp`` it is built on ``meta``, its initialisation
    logged (:mod:`.stage_init`): :func:`pipeline_stage` gives storage to this rank's stage alone,
    with the values a whole build gives (or its pretrained tensors), and moves it to the device."""
    if cfg.pp == 1:
        model = build_model(cfg.model, device, torch.float32, seed=cfg.seed)
    else:
        model, recipe = _meta_model(cfg)
        _ON_META[model] = recipe
    check_attention(model.config, named)  # as built: defaults the file left out
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    return model


_ON_META: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A model :func:`checked_model` built on ``meta`` -> how its stage gets its values: the
initialisation log, or the folder of its pretrained weights."""


def _meta_model(cfg: TrainConfig) -> tuple[torch.nn.Module, InitLog | Path]:
    """``--model`` on ``meta``: a pretrained folder's architecture (its weights are read per
    stage), else the seeded build with its initialisation logged."""
    path = Path(cfg.model)
    if path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
        from transformers import AutoConfig, AutoModelForCausalLM

        from ..models.attention import IMPLEMENTATION, register

        register()
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):  # transformers skips initialising on meta: the files hold the values
            model = AutoModelForCausalLM.from_config(config, attn_implementation=IMPLEMENTATION)
        return model.to(dtype=torch.float32), path
    return build_on_meta(lambda: build_model(cfg.model, "meta", torch.float32, seed=cfg.seed))


def pipeline_stage(cfg: TrainConfig, rt: Runtime, model: torch.nn.Module) -> StageModel | None:
    """``--pp P``: this rank's stage of ``model`` (the other stages' layers dropped), the layers
    split by cost (:func:`~sparsebalance.batching.schedule.balanced_layers`, the LM head weighed
    from the model's shapes: fixed by the model alone, so a resumed run splits alike), sharded
    over the stage's data-parallel peers with ``--parallel fsdp2``; None without a pipeline. A
    model :func:`checked_model` built on ``meta`` gets storage for this stage alone (on the host,
    :func:`.stage_init.materialise`), which alone then moves to ``rt.device``."""
    if cfg.pp == 1:
        return None
    check_pipeline_model(model.config, cfg.pp)
    shapes = ModelShapes.from_hf_config(model.config.to_dict())
    stages = cfg.pp * cfg.pp_virtual  # --pp-virtual: the split is per virtual stage
    split = tuple(balanced_layers(shapes.num_layers, stages, head_layers(shapes)).tolist())
    layout = PipelineLayout.of(rt.rank, rt.world_size, cfg.pp, split, cfg.pp_virtual)
    stage = StageModel(model, layout)
    recipe = _ON_META.pop(model, None)
    if recipe is not None:  # built on meta: this stage alone gets storage and values
        materialise(model, recipe if isinstance(recipe, InitLog) else None)
        if isinstance(recipe, Path):
            load_stage_weights(model, recipe, stage.names)
    stage = stage.to(rt.device)
    if cfg.parallel == "fsdp2":  # each stage sharded over its peers in the other pipelines
        from torch.distributed.device_mesh import init_device_mesh

        grid = (stage.layout.dp_size, stage.layout.stages)  # world rank = dp x P + stage
        mesh = init_device_mesh(rt.device.type, grid, mesh_dim_names=("dp", "pp"))["dp"]
        stage.shard(mesh, resolve_precision(cfg.precision, rt.device))
    return stage


def fit_vocabulary(corpus: TokenizedCorpus, model: torch.nn.Module) -> TokenizedCorpus:
    """The corpus in the model's vocabulary: token ids past it mapped to a compact one."""
    vocab = int(model.config.vocab_size)
    if corpus.max_token_id() >= vocab:
        corpus = apply_vocabulary(corpus, compact_vocabulary(corpus, vocab))
    return corpus


def fit_capacity(
    cfg: TrainConfig,
    rt: Runtime,
    model: torch.nn.Module,
    shapes: ModelShapes,
    kernel,
    base_rss: int,
    stage: StageModel | None = None,
) -> tuple[int, MemoryBound]:
    """``--capacity auto``: the largest micro-batch whose predicted peak fits the budget (the
    smallest over ranks, so every rank plans with the same bound: with ``--pp`` each rank
    prices its own ``stage``, and the first stage, which keeps the most micro-batches in
    flight, usually binds), and the bound (``sab-cp`` takes each document's minimum CP degree
    from it). The memory model uses the coefficients ``sparsebalance profile --memory``
    measured for this setup (from ``--profile``'s ``meta["memory"]`` or the cache) when there
    are some, else the analytic ones; the line printed says which. ``kernel``: the run's
    resolved attention kernel (precision, backend)."""
    dev = rt.device
    analytic = device_coefficients(dev, base_rss)
    tied = stage.tied if stage is not None else tied_head(model)  # the head is the embedding
    running = memory_fingerprint(fingerprint(shapes, dev, kernel.precision, kernel.backend, cfg.block_size), tied)
    meta = load_profile(cfg.profile).meta if cfg.profile else None
    cal, source = find_calibration(running, meta, checkpointing=cfg.activation_checkpointing)
    coeffs = cal.coefficients(analytic) if cal is not None else analytic
    budget = parse_bytes(cfg.memory_budget) if cfg.memory_budget else with_budget_fraction(coeffs)
    mem_cfg = _memory_config(cfg, rt.world_size, stage)
    mine = MemoryModel(shapes, coeffs, tied)
    # Every rank plans with the most constrained rank's model (same plan, same hash).
    gathered = rt.all_gather_object((auto_capacity(mine, budget, mem_cfg), coeffs, budget, mem_cfg))
    binding = min(range(len(gathered)), key=lambda r: gathered[r][0])  # ties: the lowest rank
    cap, coeffs, budget, mem_cfg = gathered[binding]
    memory = MemoryModel(shapes, coeffs, tied)
    if rt.is_main:
        st = mem_cfg.stage  # world rank = pipeline x P + stage
        where = (
            ""
            if st is None
            else f" on stage {binding % cfg.pp} of {cfg.pp}, {st.in_flight:g} "
            + (
                "micro-batches in flight"
                if cfg.pp_virtual == 1
                else "stages' worth of activations in flight (interleaved)"
            )
        )
        print(
            f"sparsebalance train: --capacity auto = {cap} tokens per micro-batch (predicted "
            f"peak {memory.peak_bytes(cap, mem_cfg) / GIB:.2f} GiB of a {budget / GIB:.2f} GiB "
            f"budget{where}, {coeffs.name}; {source})",
            file=sys.stderr,
        )
    return cap, MemoryBound(memory, budget, mem_cfg)


def _memory_config(cfg: TrainConfig, world_size: int, stage: StageModel | None) -> MemoryConfig:
    """What changes this rank's peak: checkpointing, the loss, the FSDP2 degree (the stage's
    data-parallel peers with ``--pp``), whether a step may run several micro-batches per rank,
    and ``--pp``'s stage with the micro-batches in flight on it. A rank's micro-batches are
    bounded only by the global batch (SAB may give one pipeline more documents than its share
    to shorten its bubbles; ``sab-cp`` puts a unit of several documents on one rank), and only
    when no document is split (``--overlong split`` makes a micro-batch of every piece)."""
    pipelines = world_size // cfg.pp
    most = cfg.global_batch if cfg.overlong != "split" else None
    share = None
    if stage is not None:
        p, s = stage.layout.stages, stage.layout.stage
        share = StageShare.of(stage.rank_split, s)
        if stage.layout.virtual > 1:  # interleaved: warm-up forwards of several chunks in flight
            counts = range(1, min(most or HELD_LIMIT, HELD_LIMIT) + 1)
            share = replace(share, in_flight=held_stages(stage.split, p, s, counts))
        elif cfg.pp_schedule == "zb-h1":  # zero bubble: 1F1B's in flight, and up to s + 1 pending W's
            counts = range(1, min(most or HELD_LIMIT, HELD_LIMIT) + 1)
            pending = max(pending_weights(p, m, s) for m in counts)
            share = replace(share, in_flight=min(share.in_flight, most or p), pending_weights=pending)
        elif most is not None:
            share = replace(share, in_flight=min(share.in_flight, most))
    return MemoryConfig(
        cfg.activation_checkpointing,
        "plain" if cfg.loss == "plain" else "chunked",
        shard=pipelines if cfg.parallel == "fsdp2" else 1,
        micro_batches=1 if most == 1 else 2,
        reduce_every=cfg.fsdp_sync_every_micro_batch,
        ddp=cfg.parallel == "ddp" and cfg.pp == 1 and pipelines > 1,
        stage=share,
        block_size=cfg.block_size,
    )


def check_run_folder(cfg: TrainConfig) -> list[Path]:
    """Refuse an ``--out`` holding an earlier run unless ``--resume`` or ``--overwrite``; return
    what ``--overwrite`` removes when the run starts (``launch-config.json`` is this launch's)."""
    run_dir = Path(cfg.out)
    earlier = [run_dir / n for n in earlier_run(run_dir)]
    if earlier and not cfg.resume and not cfg.overwrite:
        raise ValueError(
            f"--out {run_dir} holds an earlier run "
            f"({', '.join(p.name for p in earlier)}): pass --resume to continue it or "
            "--overwrite to replace it"
        )
    stale = [p for n in RUN_FILES if (p := run_dir / n).exists()]
    return [p for p in stale if p.name != "launch-config.json"] if cfg.overwrite else []


def write_run_folder(
    rt: Runtime, cfg: TrainConfig, stale: list[Path], latency: LatencyModel, topology: Topology, data
) -> None:
    """Rank 0, as the run starts: the earlier run's files gone (``--overwrite``), an interrupted
    save's leftovers removed, then ``config.json``, ``latency_profile.json`` (what planned the
    run), ``topology.json`` and ``data.json``; one line per data component that lost documents."""
    if not rt.is_main:
        return
    run_dir = Path(cfg.out)
    for path in stale:  # --overwrite: the earlier run's files go
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    for path in clean_temporaries(run_dir):  # an interrupted save's leftovers
        say(rt, f"removed {path.name}, left by an interrupted checkpoint save")
    (run_dir / "config.json").write_text(json.dumps(to_record(cfg), indent=1, default=str))
    latency.profile.save(run_dir / "latency_profile.json")
    (run_dir / "topology.json").write_text(json.dumps(topology.describe()) + "\n")
    described = data.describe()
    (run_dir / "data.json").write_text(json.dumps(described, indent=1) + "\n")
    for comp in described["components"]:
        if comp["usable"] < comp["documents"]:
            dropped = comp["documents"] - comp["usable"]
            print(f"data {comp['name']}: {dropped} of {comp['documents']} documents filtered out ({comp['filtered']})")
