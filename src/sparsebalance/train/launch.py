"""``sparsebalance train``: launch torchrun with the resolved config; ``--demo`` runs the baseline
and SparseBalance on the same samples and compares them."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .checkpoint import find_checkpoint
from .config import TrainConfig, check_batch, check_pipeline_world, earlier_run, resolve_strategy
from .config_io import to_record
from .multinode import Rendezvous, Topology
from .resume import check_grid, check_same_run, check_steps, is_complete, saved_identity
from .runlock import ENV_TOKEN, FOLLOW, RunLock
from .signals import HANDLED, die_with_parent
from .supervise import STOP_GRACE, check_stop_grace, current_stop_grace, supervise

LAUNCHER_PID = "SPARSEBALANCE_LAUNCHER_PID"
CPU_NPROC = 2  # processes `sparsebalance train` starts on a CPU machine without --nproc


def uses_cuda(cfg: TrainConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


_ON_START: contextvars.ContextVar[Callable[[TrainConfig], None] | None] = contextvars.ContextVar(
    "on_start", default=None
)


@contextlib.contextmanager
def on_start(callback: Callable[[TrainConfig], None]):
    """Inside it, :func:`launch` calls ``callback(cfg)`` (the run's resolved configuration) once
    the run has passed every check (:func:`preflight`), just before its ranks start: a command
    says a run started only when it does, never before a refusal."""
    token = _ON_START.set(callback)
    try:
        yield
    finally:
        _ON_START.reset(token)


def _started(cfg: TrainConfig) -> None:
    callback = _ON_START.get()
    if callback is not None:
        callback(cfg)


def add_nproc_argument(p) -> None:
    """``--nproc``, one definition for every command that launches ranks (its default:
    :func:`default_nproc`)."""
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes on this machine (default: the number of GPUs on CUDA, 2 on CPU, 1 with --emulate-ranks)",
    )


def default_nproc(cfg: TrainConfig, requested: int | None, cpu: int = CPU_NPROC) -> int:
    """Processes to launch: ``--nproc``, else 1 with ``--emulate-ranks``, else the GPU count on
    CUDA and ``cpu`` (:data:`CPU_NPROC`; the demo's :data:`DEMO_CPU_RANKS`) on CPU, or ``--pp``
    when that count is not a multiple of it (one pipeline; two with ``--parallel fsdp2``)."""
    check_device(cfg)
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--nproc must be >= 1, got {requested}")
        if cfg.emulate_ranks and requested != 1:
            raise ValueError(f"--emulate-ranks runs in one process: use --nproc 1, not {requested}")
        return requested
    if cfg.emulate_ranks:
        return 1
    if uses_cuda(cfg):
        return torch.cuda.device_count()  # one per GPU: a --pp that does not divide it is refused
    if cfg.pp > 1 and cfg.parallel == "fsdp2":  # CPU: two pipelines, the fewest FSDP2 shards over
        return max(cpu - cpu % cfg.pp, 2 * cfg.pp)
    return cpu if cpu % cfg.pp == 0 else cfg.pp  # CPU --pp P: one pipeline of P processes


def check_device(cfg: TrainConfig) -> None:
    """``--device cuda`` needs a GPU this process can see: said in one line before anything
    (not as a count of zero processes)."""
    if cfg.device == "cuda" and torch.cuda.device_count() == 0:
        raise ValueError(
            "--device cuda: no CUDA device is visible on this machine (torch.cuda.device_count() "
            "is 0; check CUDA_VISIBLE_DEVICES and the driver): use --device cpu or auto"
        )


def rank_threads(nproc: int, env: dict[str, str] | None = None) -> int:
    """CPU threads each training rank's torch runs with: ``OMP_NUM_THREADS`` if set, else 1 when
    torchrun starts more than one process per machine (torchrun sets ``OMP_NUM_THREADS=1``
    then), else torch's default (the physical cores). The latency profile must be measured with
    this count: matmuls and attention scale differently with threads."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        value = env["OMP_NUM_THREADS"]
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"OMP_NUM_THREADS must be an integer >= 1, got {value!r}")
        return int(value)
    return 1 if nproc > 1 else torch.get_num_threads()


class RunFailed(RuntimeError):
    """Training ended with a non-zero exit code. ``reported``: the run already said why (rank 0
    printed its one line), so the launcher adds nothing."""

    def __init__(self, code: int, message: str, reported: bool) -> None:
        super().__init__(message)
        self.code, self.reported = code, reported


REPORTED_CODES = {2, 3} | {128 + s for s in HANDLED}  # user error, non-finite loss, signals


def check_pipeline_grid(cfg: TrainConfig, nproc: int, num_layers: int) -> None:
    """``--pp``: the processes split into whole pipelines, and no more stages than layers."""
    from ..batching.interleaved import check_virtual
    from ..batching.schedule import stage_layers

    check_pipeline_world(cfg, nproc)
    stage_layers(num_layers, cfg.pp)  # more stages than layers: refused
    check_virtual(cfg.pp, cfg.pp_virtual, num_layers)  # more virtual stages than layers: refused


def preflight(cfg: TrainConfig, nproc: int, multinode: bool = False, said: set[str] | None = None) -> str | None:
    """Everything cheap that can fail, before any process starts or anything is profiled: the
    model's config, the tokenizer, the data (read and tokenized into the shared cache, which the
    workers then read), the global batch against the dataset and the ranks, ``--ranks-per-node``
    against the ranks, and with ``--resume`` that the checkpoint belongs to this run and that
    ``--steps`` does not ask for fewer steps than it has. Returns the line to print instead of
    launching when ``--resume`` has nothing to train (the run is complete; on one machine: other
    machines' ranks would wait for node 0's), else None. ``said``: the notes already printed (runs
    launched together say a shared one once)."""
    from ..data import load_corpus, load_tokenizer
    from ..latency import check_profile_fits, load_profile
    from ..models import check_trainable

    check_device(cfg)
    check_run_folder(cfg)
    path = None
    if cfg.resume:  # the same run or a refusal listing the differences (rank 0 repeats it)
        # every check but the hashes (rank 0 hashes, and names what it skips): a damaged
        # newest checkpoint (a truncated meta.json included) is passed over for the one before
        path = find_checkpoint(Path(cfg.out), verify=False)[0]
        if path is None:
            raise ValueError(f"--resume: no intact checkpoint in {Path(cfg.out) / 'checkpoints'}")
        check_same_run(path, cfg, None)  # the data's content: once it is read, below
        check_steps(path, cfg)  # --steps 6 from step 10: refused, not a run that trains nothing
        if not multinode and is_complete(path, cfg):
            return (
                f"--resume: the run in {cfg.out} is complete ({path.name} of --steps "
                f"{cfg.steps}): nothing to train; pass --steps > {cfg.steps} to train it "
                "further"
            )
        # another --pp or --nproc is resharded (rank 0 says what it changes); format 2 is refused
        check_grid(path, cfg, nproc)
    shapes = check_trainable(cfg.model)  # a sliding window: refused before it is profiled
    check_pipeline_grid(cfg, nproc, shapes.num_layers)
    if cfg.profile:  # readable, and for this run (also on --resume, where it may change)
        profile = load_profile(cfg.profile)
        check_profile_fits(
            profile, shapes, cfg.block_size, "cuda" if uses_cuda(cfg) else "cpu", f"--profile {cfg.profile}"
        )
    corpus = load_corpus(
        cfg.data,
        load_tokenizer(cfg.tokenizer),
        cfg.text_field,
        cfg.num_builtin,
        cfg.seed,
        cfg.min_len,
        cfg.max_len,
        on_bad_record=cfg.on_bad_record,
        progress=sys.stderr.isatty(),
    )
    if path is not None:  # changed data: refused here, not by rank 0 after the launch
        check_same_run(path, cfg, launch_identity(path, corpus))
    check_batch(cfg, len(corpus), cfg.emulate_ranks or nproc)
    if cfg.ranks_per_node is not None:  # must divide the ranks (raises naming the flag)
        Topology(cfg.emulate_ranks or nproc, cfg.ranks_per_node)
    note = overlong_note(cfg, corpus.lengths(), cfg.emulate_ranks or nproc)
    if note is not None and note not in (said or ()):
        print(f"sparsebalance train: {note}", file=sys.stderr, flush=True)
        if said is not None:
            said.add(note)
    return None


def launch_identity(checkpoint: Path, corpus) -> dict:
    """The data identity the ranks will compute, as far as the launcher knows it: everything
    but the compact vocabulary's size (it depends on the model, which the launcher does not
    build; rank 0 checks it), taken from the checkpoint so that it never differs here."""
    saved = saved_identity(checkpoint)[1] or {}
    return {**corpus.identity(), "vocab_map_size": saved.get("vocab_map_size")}


def check_run_folder(cfg: TrainConfig) -> None:
    """``--out`` before anything is written there: a folder holding an earlier run needs
    ``--resume`` or ``--overwrite``; one whose ``config.json`` is not a run's (a model folder) is
    never written into."""
    out = Path(cfg.out)
    if not out.is_dir():
        return
    config = out / "config.json"
    if config.is_file() and not _is_run_config(config):
        raise ValueError(
            f"--out {out}: its config.json is not a SparseBalance run's (a model folder?); choose another --out"
        )
    # what only training writes: a start that failed early left at most configs (rewritten)
    earlier = earlier_run(out)
    if earlier and not (cfg.resume or cfg.overwrite):
        raise ValueError(
            f"--out {out} holds an earlier run ({', '.join(earlier)}): pass --resume to "
            "continue it or --overwrite to replace it"
        )


def _is_run_config(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and ("schema_version" in data or {"global_batch", "dst"} <= set(data))


def overlong_note(cfg: TrainConfig, lengths, num_ranks: int) -> str | None:
    """The line saying what happens to documents no unit can hold (None when there are none):
    over ``--capacity`` without CP units, over the widest unit's tokens with ``sab-cp``."""
    if not isinstance(cfg.capacity, int):  # --micro-batches: no token bound; auto: not known yet
        return None
    cap = int(cfg.capacity)
    if cfg.strategy == "sab-cp":
        k = cfg.cp or num_ranks
        limit, what = k * cap, f"{k} ranks x --capacity {cap} = {k * cap} tokens"
    else:
        limit, what = cap, f"--capacity {cap}"
    over = int((lengths > limit).sum())
    if over == 0:
        return None
    fate = {
        "split": f"cut into {limit}-token chunks trained as separate documents",
        "truncate": f"truncated to their first {limit} tokens",
        "skip": "not trained",
    }[cfg.overlong]
    if cfg.strategy == "sab-cp":
        why = "no unit of ranks holds them"
    elif cfg.emulate_ranks:
        why = "CP units cannot run with --emulate-ranks (one process)"
    elif cfg.pp > 1:
        why = f"CP units cannot run with --pp {cfg.pp}"
    elif num_ranks < 2:
        why = "CP units need >= 2 ranks"
    else:
        why = "--strategy sab-cp would train them whole over several ranks"
    return f"{over} of {lengths.size} documents are longer than {what}: --overlong {cfg.overlong}: {fate} ({why})"


def launch(
    cfg: TrainConfig,
    nproc: int,
    rdzv: Rendezvous | None = None,
    stop_grace: float | None = None,
    together: Sequence[TrainConfig] = (),
) -> bool:
    """Run ``torchrun --standalone --nproc_per_node nproc -m sparsebalance.train`` (or a single
    process when ``nproc == 1``) holding the run folder's lock; raises ``ValueError`` for bad
    input found before launching and :class:`RunFailed` if training fails or is stopped.
    Returns whether anything was launched: not for a ``--resume`` of a complete run (said in
    one line).

    With ``rdzv.nnodes > 1`` torchrun joins the c10d rendezvous instead; node 0 holds the lock
    and writes the run folder, the other nodes only read their own copy of the config.

    The workers die with this process: torchrun runs in its own session (only this process
    receives the terminal's Ctrl-C and forwards it once) and gets SIGTERM when this process dies,
    even by SIGKILL; its workers get SIGKILL when torchrun dies (:func:`die_with_parent`).
    A first SIGINT/SIGTERM stops the run (at the next step boundary, with a checkpoint), however
    long that step or save takes up to ``stop_grace`` seconds (:func:`supervise`; default
    :func:`stop_grace`'s, else :data:`STOP_GRACE`); a second one kills it.

    ``together``: further runs on one machine stepped in turn with ``cfg`` by the same ranks
    (:func:`~.interleave.run_interleaved`, ``train --demo``), each checked, locked and written to
    its own folder as ``cfg`` is."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    stop_grace = current_stop_grace() if stop_grace is None else stop_grace
    check_stop_grace(stop_grace)
    rdzv = rdzv or Rendezvous()
    cfg = resolve_strategy(cfg, nproc * rdzv.nnodes)  # --strategy auto
    if rdzv.node_rank > 0:
        return launch_follower(cfg, nproc, rdzv, stop_grace)
    if together and rdzv.multinode:
        raise ValueError("runs stepped together run on one machine: drop --nnodes")
    runs = [cfg, *(resolve_strategy(c, nproc) for c in together)]
    outs = [Path(c.out) for c in runs]
    created = [not out.exists() for out in outs]
    lock = RunLock(outs[0])
    try:
        with lock, contextlib.ExitStack() as held:
            for out in outs[1:]:  # the others under the same token: the workers join each
                held.enter_context(RunLock(out, lock.token))
            if lock.note:
                print(f"sparsebalance train: note: {lock.note}", file=sys.stderr, flush=True)
            said: set[str] = set()
            for run in runs:
                complete = preflight(run, nproc * rdzv.nnodes, rdzv.multinode, said)
                if complete is not None:
                    print(f"sparsebalance train: {complete}", file=sys.stderr, flush=True)
                    return False
            worker = ["-m", "sparsebalance.train"]
            for run, out in zip(runs, outs, strict=True):
                _started(run)
                cfg_path = out / "launch-config.json"
                cfg_path.write_text(json.dumps(to_record(run), indent=1) + "\n")  # whole nested config
                worker += ["--config" if run is cfg else "--interleave", str(cfg_path)]
            torchrun = nproc > 1 or rdzv.multinode
            if not torchrun:
                cmd = [sys.executable, *worker]
            else:
                cmd = [sys.executable, "-c", TORCHRUN, *rdzv.torchrun_args(nproc), *worker]
            env = {**os.environ, ENV_TOKEN: lock.token, LAUNCHER_PID: str(os.getpid())}
            rc = supervise(cmd, env, stop_grace, torchrun)
    except ValueError:
        for out, new in zip(outs, created, strict=True):
            if new and out.is_dir() and not any(out.iterdir()):
                out.rmdir()  # a refused run leaves no empty folder behind
        raise
    check_exit(rc)
    return True


def check_exit(rc: int) -> None:
    if rc != 0:
        reported = rc in REPORTED_CODES
        raise RunFailed(rc, f"training exited with code {rc}", reported)


def launch_follower(cfg: TrainConfig, nproc: int, rdzv: Rendezvous, stop_grace: float = STOP_GRACE) -> bool:
    """A node other than 0: torchrun joins the rendezvous with this machine's ``nproc`` ranks;
    no lock of its own, nothing written here (its config goes to a private temporary file). The
    rendezvous may make one of these ranks global rank 0: it then joins node 0's lock in the
    shared ``--out`` folder and writes the run folder."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sparsebalance-node") as tmp:
        cfg_path = Path(tmp) / "launch-config.json"
        cfg_path.write_text(json.dumps(to_record(cfg), indent=1) + "\n")
        worker = ["-m", "sparsebalance.train", "--config", str(cfg_path)]
        cmd = [sys.executable, "-c", TORCHRUN, *rdzv.torchrun_args(nproc), *worker]
        env = {**os.environ, ENV_TOKEN: FOLLOW, LAUNCHER_PID: str(os.getpid())}
        _started(cfg)
        rc = supervise(cmd, env, stop_grace, torchrun=True)
    check_exit(rc)
    return True


# torchrun through a wrapper that dies with the launcher and ends quietly: the ranks print
# their own one-line message; torchrun's failure table and signal traceback add nothing.
TORCHRUN = "from sparsebalance.train.launch import torchrun_main; torchrun_main()"


def torchrun_main() -> None:
    """``python -m torch.distributed.run`` (arguments from ``sys.argv[1:]``) that gets SIGTERM
    when its launcher dies and exits with the first failed worker's code (no traceback)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    die_with_parent(signal.SIGTERM, int(os.environ.get(LAUNCHER_PID, os.getppid())))
    # No banner, no shutdown chatter, no "failed (exitcode: 143)" when the ranks stop after a
    # signal: a failure is this wrapper's one line (below) or the ranks' own. Some of torch's
    # loggers set their own level when created (on import, above), so each is quietened.
    quiet = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")
    for name in [*quiet, *logging.root.manager.loggerDict]:
        if name.startswith(quiet):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        main()
    except SignalException as err:
        sys.exit(128 + int(err.sigval))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        if code not in REPORTED_CODES:
            print(f"sparsebalance train: rank {rank} failed with exit code {code}", file=sys.stderr)
        sys.exit(code)
