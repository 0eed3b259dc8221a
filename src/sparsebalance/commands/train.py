"""``sparsebalance train``: distributed training of a Hugging Face causal LM with packed sparse
attention, SAB and DST (launches torchrun itself). ``--demo`` trains the baseline (sequential
batching, a fixed base budget) and SparseBalance (SAB + CP + DST) on the same ranks, a step of each
in turn on the same samples, and compares them: the speed-up with a 95 % interval from the step
pairs, the machine and its load, and whether that is conclusive."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

from ..report import write_report
from ..train import TrainConfig, add_train_arguments, config_from_args
from ..train.config import resolve_strategy
from ..train.demo import DEMO_CPU_RANKS, DEMO_DEFAULTS, demo_configs
from ..train.launch import RunFailed, add_nproc_argument, default_nproc, launch, on_start, uses_cuda
from ..train.multinode import Rendezvous
from ..train.supervise import add_stop_grace_argument, stop_grace
from ..verdict import machine_end, machine_start, rerun_command, write_machine


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_nproc_argument(p)
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines in the run; 1 runs torchrun --standalone",
    )
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index in [0, nnodes)")
    p.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT of the c10d rendezvous (node 0), required with --nnodes > 1; trusted "
        "network only: the store has no authentication and ranks unpickle each other's data",
    )
    p.add_argument(
        "--rdzv-id",
        default=None,
        help="id of this run, unique and the same on every machine; required with --nnodes > 1 (e.g. $SLURM_JOB_ID)",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="baseline vs SparseBalance (SAB + CP + DST; SAB + DST with --pp), stepped in turn on the same "
        "samples, then a comparison with a 95 %% interval, the machine and its load + report; --capacity 2100 "
        "and (on CPU) 2 ranks unless given",
    )
    p.add_argument("--json", action="store_true", help="print only JSON (the comparison) to stdout")
    add_stop_grace_argument(p)
    add_train_arguments(p)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, DEMO_DEFAULTS if args.demo else None)
    nproc = default_nproc(cfg, args.nproc, DEMO_CPU_RANKS if args.demo else 2)
    with stop_grace(args.stop_grace):  # checked here, before anything is said to start
        return _launch_all(args, cfg, nproc)


def _launch_all(args: argparse.Namespace, cfg, nproc: int) -> int:
    """Launch the run (or the demo's two, stepped in turn by the same ranks) and write its
    report; the exit code."""
    rdzv = Rendezvous(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id)
    if rdzv.multinode and args.demo:
        raise ValueError("--demo runs on one machine: drop --nnodes")
    runs = demo_configs(cfg) if args.demo else {"run": resolve_strategy(cfg, nproc * rdzv.nnodes)}
    first, *others = runs.values()
    # each run's line once launch has checked it (a refused run never says it started)
    names = {str(c.out): name for name, c in runs.items()}
    said = contextlib.nullcontext() if args.json else on_start(_say(names, nproc * rdzv.nnodes))
    machine = machine_start(_device(cfg), nproc, rerun_command(cfg.pp, cfg.pp_virtual, cfg.pp_schedule))
    try:
        with said:
            launched = launch(first, nproc, rdzv, together=others)
    except RunFailed as err:
        if err.reported:  # rank 0 already said why in one line
            return err.code
        raise
    if args.demo and launched:  # the verdict's machine: what it is, how busy at the start and the end
        write_machine(Path(cfg.out), machine_end(machine))
    if rdzv.node_rank > 0:  # node 0 writes the run folder and its report
        return 0
    if not launched:  # --resume of a complete run: its report is there already
        comparison = Path(cfg.out) / "comparison.json"
        if args.json and comparison.is_file():
            print(comparison.read_text().strip())
        return 0
    path, comparison = write_report(Path(cfg.out))
    if args.json:
        print(json.dumps(comparison, indent=2))
    else:
        text = path.read_text()
        said = ("Long documents", "Budgets", "DST, ", "Pipeline, ", "Verdict: ", "Machine: ")
        longdocs = [x for x in text.split("\n") if x.startswith(said)]
        print("\n\n".join([text.split("\n\n")[1], *longdocs]) + f"\n\nreport: {path}")
    return 0


def _device(cfg: TrainConfig) -> str:
    """The device a run trains on, named (the verdict's machine)."""
    import torch

    if uses_cuda(cfg):
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return "cpu"


def _say(names: dict[str, str], ranks: int) -> Callable[[TrainConfig], None]:
    """What prints ``== NAME: ...``, the line a run starts with (``names``: its folder -> name)."""

    def say(cfg: TrainConfig) -> None:
        virtual = f", {cfg.pp_virtual} chunks a stage" if cfg.pp_virtual > 1 else ""
        virtual += ", zero bubble" if cfg.pp_schedule == "zb-h1" else ""
        layout = f"ranks={ranks}" if cfg.pp == 1 else f"ranks={ranks} (DP {ranks // cfg.pp} x PP {cfg.pp}{virtual})"
        print(
            f"== {names[str(cfg.out)]}: strategy={cfg.strategy}, dst={cfg.dst.mode}, {layout}, steps={cfg.steps} "
            f"-> {cfg.out}",
            flush=True,
        )

    return say
