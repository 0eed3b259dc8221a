"""``--plan-ahead``: the next step planned (SAB) and tuned (DST) while this step runs on the device.

Without it the host plans step n + 1 after step n's times are read back and fed into the latency
model: on a GPU the device waits for SAB and DST each step (tens of milliseconds at DP2 PP4, more
as ranks x micro-batches grow; ``benchmarks/bench_plan.py``). With it the executor calls
:func:`plan_next` once step n's forwards and backwards are launched, before the host waits for
the device, so the planning runs in the device's shadow::

    step n:   launch F/B ... | plan + tune n+1 (host) | wait, read times | sync, update | feedback n
    device:   F/B of step n ........................................... | optimizer

What changes: step n + 1 is planned from the latency model, estimator and stage pricing as step
n - 1's feedback left them (one step older); the feedback itself is the same, and DST's layer
controllers, built during step n + 1 from the newer model, re-base the decision's time targets
on it (``TunedStep.ahead``). The plan agreement of step n + 1 (an all-gather of its hash, on the
host: gloo, or the host-side group beside NCCL) runs at the same point on every rank, once every
rank has launched its work: a host read inside a step delays it for all.

The last step plans one more (its batch is not trained): its checkpoint then resumes a longer
run exactly as the uninterrupted longer run would have gone on.

Exact resume: a checkpoint written after step n holds the sampler's position *before* step
n + 1's batch was drawn and the engine state that planned it (:class:`Ahead`); a resumed run
re-plans step n + 1 from them (:func:`replan`) and then restores the engine state after step n's
feedback, so it runs the plans and budgets the uninterrupted run ran. Exact when the mode is the
same on both sides: a resume that switches it plans step n + 1 as its own mode does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from ..data.batches import BatchSource
from ..engine import StepEngine, TunedStep

MODES = ("auto", "on", "off")


@dataclass
class Ahead:
    """The next step, planned and tuned before this step's feedback."""

    tuned: TunedStep
    documents: dict[str, int]
    """Its global batch's documents per ``--data`` component (the step's metrics)."""
    data_state: dict
    """The sampler's position before its batch was drawn (what a checkpoint saves)."""
    engine_state: dict
    """The engine's state that planned it (:meth:`StepEngine.state_dict`)."""
    shadowed: bool = True
    """Planned during the previous step's device work (False: re-planned at a resume)."""


def resolve(mode: str, device: torch.device) -> bool:
    """``--plan-ahead`` on ``device``: auto plans ahead on CUDA only (on the CPU the host is the
    device: nothing would overlap, and plans would only be one step older)."""
    if mode not in MODES:
        raise ValueError(f"--plan-ahead must be one of {MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def plan_next(data: BatchSource, engine: StepEngine) -> Ahead:
    """Draw the next global batch and plan and tune it (one all-gather: every rank, same point)."""
    data_state = copy.deepcopy(data.state_dict())
    engine_state = copy.deepcopy(engine.state_dict())
    samples = data.next_batch()
    documents = dict(data.metrics()["documents"])
    return Ahead(engine.begin(samples, ahead=True), documents, data_state, engine_state)


def replan(engine_state: dict, data: BatchSource, engine: StepEngine) -> Ahead:
    """After a resume (``data`` at the saved position before the batch): the step the saving run
    had planned ahead, re-planned from the ``engine_state`` that planned it; the engine's own
    state (after the saved step's feedback) is restored afterwards."""
    now = copy.deepcopy(engine.state_dict())
    engine.load_state_dict(copy.deepcopy(engine_state))
    try:
        return replace(plan_next(data, engine), shadowed=False)
    finally:
        engine.load_state_dict(now)
