"""Several runs stepped in turn on one set of ranks (``train --demo``'s baseline and
SparseBalance): step 1 of each, then step 2 of each, and so on, on the same samples (the runs
share the data's seed and global batch). A change in the machine's load lands on both runs
alike, so their step-paired ratio says more than two runs one after the other (issue 55: a
busy machine made the later run look 0.89x).

Every run keeps its own folder, model, optimizer, latency model, metrics and checkpoint, as if
launched alone (two trainers in one process step exactly as they step apart: their samples,
plans and losses are their own). The order alternates every step (A B, B A, ...) so neither run
always follows the other's gradient sync. One progress bar shows them all.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Sequence

from tqdm import tqdm

from .signals import Stopped
from .trainer import Trainer


def run_interleaved(trainers: Sequence[Trainer]) -> list[dict]:
    """Train ``trainers`` (same ``--steps``, each from its own start) in turn, one step each at a
    time; each one saved at the end, as :meth:`Trainer.run` does. Returns what :meth:`Trainer.run`
    returns, per trainer. A SIGINT/SIGTERM stops them all at a step boundary, each saved."""
    steps = {t.cfg.steps for t in trainers}
    if len(steps) != 1:
        raise ValueError(f"interleaved runs need the same --steps, got {sorted(steps)}")
    (total,) = steps
    first = trainers[0]
    tels = [t.open_run(bar=False) for t in trainers]
    summaries: list[list[dict]] = [[] for _ in trainers]
    labels = " | ".join(f"{t.cfg.strategy}+dst-{t.cfg.dst.mode}" for t in trainers)
    bar = tqdm(total=total, initial=min(t.step for t in trainers), desc=labels, file=sys.stderr, mininterval=0.5)
    bar.disable = bar.disable or not first.rt.is_main
    stops = first.stops.deferred() if first.stops is not None else contextlib.nullcontext()
    try:
        with stops:
            while any(t.step < total for t in trainers):
                turn = list(enumerate(trainers))
                for i, trainer in turn if first.step % 2 == 0 else reversed(turn):
                    if trainer.step < total:
                        result = trainer.run_step()
                        tels[i].log(trainer.step, result)
                        summaries[i].append(result.report.to_log())
                bar.set_postfix(loss=" | ".join(f"{s[-1]['loss']:.3f}" for s in summaries if s))
                bar.update(1)
                signum = first.stops.agreed(first.rt) if first.stops is not None else None  # one for all
                if signum is not None and first.step < total:
                    for trainer in trainers:
                        trainer.save()
                    name = signal.Signals(signum).name
                    raise Stopped(signum, f"stopped by {name} after step {first.step}: each run's checkpoint saved")
            for trainer in trainers:
                trainer.save()
    finally:
        bar.close()
        for tel in tels:
            tel.close()
    return [
        {"steps": t.step, "losses": [s["loss"] for s in done], "summaries": done}
        for t, done in zip(trainers, summaries, strict=True)
    ]
