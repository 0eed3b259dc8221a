"""torchrun entry point: ``torchrun --nproc_per_node N -m sparsebalance.train [flags]``.

Every way a run ends is one line from rank 0 (user error: exit 2; non-finite loss: 3; stopped by
a signal: 128 + signal; an error every rank agreed on, such as a full disk while saving, waits
until rank 0 has said it) and the other ranks stay silent, but for an error a rank meets on its
own while training (a damaged shard of a token store only it reads, say): that rank says it,
naming itself; and a peer that stalls or dies (``--comm-timeout``): each rank that waited says
where, in one line (exit 1). Rank 0 holds the run folder's lock."""

import argparse
import contextlib
import gc
import os
import signal
import sys
from pathlib import Path

from ..engine.step import NonFiniteLoss
from ..flags import command_line
from ..parallel.watch import CommTimeout
from .checkpoint import AgreedError
from .config_io import add_train_arguments, config_from_args
from .interleave import run_interleaved
from .multinode import adopt_slurm_env
from .runlock import ENV_TOKEN, RunLock, join
from .signals import Stopped, StopSignals, die_with_parent
from .trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    with command_line():  # a rank of `sparsebalance train`: messages name the flags
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    try:
        adopt_slurm_env()  # under srun without torchrun: SLURM_* -> RANK/WORLD_SIZE/LOCAL_RANK
    except ValueError as err:
        print(f"sparsebalance train: error: {err}", file=sys.stderr, flush=True)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    _follow_parent()
    stops = StopSignals().install()
    locks: list[RunLock | None] = []
    training = False  # past the set-up every rank does alike: a rank's own errors are its own
    trainers: list = []

    def say(message: str) -> None:
        if rank == 0:
            print(f"sparsebalance train: {message}", file=sys.stderr, flush=True)

    parser = argparse.ArgumentParser(prog="python -m sparsebalance.train")
    add_train_arguments(parser)
    parser.add_argument(
        "--interleave",
        action="append",
        default=[],
        metavar="CONFIG",
        help="another run's config file, stepped in turn with this one (train --demo)",
    )
    try:
        args = parser.parse_args(argv)
        cfgs = [
            config_from_args(args),
            *(config_from_args(parser.parse_args(["--config", f])) for f in args.interleave),
        ]
        for cfg in cfgs:
            locks.append(_lock_run(Path(cfg.out), rank, say))
        for cfg in cfgs:  # the runs stepped in turn share the first one's process group
            trainers.append(Trainer(cfg, trainers[0].rt) if trainers else Trainer(cfg))
            trainers[-1].stops = stops
        training = True
        if len(trainers) == 1:
            trainers[0].run()
        else:
            run_interleaved(trainers)
        _release(trainers)
    except ValueError as err:
        if rank == 0 or not training or isinstance(err, AgreedError):  # an agreed one: rank 0's
            say(f"error: {err}")
        else:
            print(f"sparsebalance train: rank {rank}: error: {err}", file=sys.stderr, flush=True)
        if isinstance(err, AgreedError):
            _together()
        return 2
    except NonFiniteLoss as err:
        say(f"stopped: {err}; the last checkpoint is intact")
        return 3
    except CommTimeout as err:  # the rank that waited says where, whichever it is; no traceback
        if stops.signum is not None:  # a peer stopping broke a collective: not a new error
            return 128 + stops.signum
        print(f"sparsebalance train: {err}; the last checkpoint is intact", file=sys.stderr, flush=True)
        return 1
    except Stopped as err:
        say(str(err))
        _release(trainers)  # a stopped run's checkpoint is saved: end as cleanly as a finished one
        return err.exit_code
    except Exception:
        if stops.signum is not None:  # a peer stopping broke a collective: not a new error
            return 128 + stops.signum
        raise
    finally:
        for lock in locks:
            if lock is not None:
                lock.release()
    return 0


def _release(trainers: list) -> None:
    """Close the process group and free the trainers now. A trainer sits in reference cycles
    (bound methods handed to its parts) that hold the DDP/FSDP model and, through it, the gloo
    process group and its last work objects: left to the interpreter's shutdown, gloo's threads
    can touch Python objects that are already gone, and a rank aborts ("terminate called without
    an active exception", exit 134) after its run ended well, or after a stop's checkpoint."""
    if trainers:
        trainers[0].rt.close()
    trainers.clear()
    gc.collect()


def _together() -> None:
    """Wait until every rank is here: torchrun stops the others at the first rank's exit, and
    rank 0 must have said the run's last line by then."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with contextlib.suppress(Exception):  # a peer already gone: nothing left to wait for
            dist.barrier()


def _follow_parent() -> None:
    """End with the process that started this one."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's worker: never outlive the agent
        die_with_parent(signal.SIGKILL)
    elif ENV_TOKEN in os.environ:  # the launcher's single process: stop cleanly if it dies
        die_with_parent(signal.SIGTERM)


def _lock_run(out: Path, rank: int, say) -> RunLock | None:
    """Rank 0 takes the run folder's lock, unless it joins the lock its launcher holds."""
    if rank != 0 or join(out, os.environ.get(ENV_TOKEN, "")):
        return None
    lock = RunLock(out).acquire()
    if lock.note:
        say(f"note: {lock.note}")
    return lock


if __name__ == "__main__":
    sys.exit(main())
