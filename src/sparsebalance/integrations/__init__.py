"""SparseBalance inside trainers people already run (HF ``Trainer`` / TRL, accelerate, plain
PyTorch loops): thin adapters over the core's stages.

- :func:`attach` (``sparsebalance.attach``): the block-sparse attention through transformers'
  ``AttentionInterface`` (:mod:`.attach`);
- :class:`StepPlanner` (:mod:`.planner`): each step's documents, SAB plan, DST budgets, this
  rank's micro-batches, and the feedback after the step;
- :class:`BalancedBatchSampler`, :class:`PlannedDataset`, :class:`PackedCollator`
  (:mod:`.sampler`): a ``DataLoader`` of planned, packed micro-batches;
- :func:`balanced_loader` / :class:`BalancedLoop` (:mod:`.loop`): the plain-loop API;
- :mod:`sparsebalance.hf`: ``enable(trainer)`` for the HF Trainer and TRL trainers.
"""

from .attach import IMPLEMENTATION, AttachedRuntime, MicroBatchTicket, attach
from .loop import BalancedLoop, LoopStep, balanced_loader
from .planner import MicroBatchSpec, PlannerConfig, StepPlanner
from .sampler import BalancedBatchSampler, MicroBatchSlot, PackedCollator, PlannedDataset
from .setup import build_sampler

__all__ = [
    "IMPLEMENTATION",
    "AttachedRuntime",
    "BalancedBatchSampler",
    "BalancedLoop",
    "LoopStep",
    "MicroBatchSlot",
    "MicroBatchSpec",
    "MicroBatchTicket",
    "PackedCollator",
    "PlannedDataset",
    "PlannerConfig",
    "StepPlanner",
    "attach",
    "balanced_loader",
    "build_sampler",
]
