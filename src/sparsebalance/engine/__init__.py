"""The step engine: one implementation of every stage of a training step, below every front end
(``sparsebalance train``'s :class:`~sparsebalance.train.Trainer`, the plain-loop API and the
sampler of :mod:`sparsebalance.integrations`, the HF Trainer callback of :mod:`sparsebalance.hf`).

    list[Sample] --begin--> TunedStep --execute (attention per micro-batch)--> LocalWork
      --synchronize--> list[RankRecord] --update--> StepReport + StepFeedback --feedback-->
      latency model, density estimator

- :class:`StepEngine` (:mod:`.engine`): what every front end touches, three verbs per step:
  ``begin`` (plan + tune), ``attention`` (a micro-batch's attention context: budget, DST's layer
  controller and timer, dense promotion, fillers, CP units), ``finish`` (every rank's records,
  bubbles, feedback), and the learned state;
- :func:`packed_attention`, :class:`LayerTimer` (:mod:`.layers`): one micro-batch's attention
  context and DST's closed-loop layer timer, for diagnostics that build one alone;
- :class:`StepRunner`, :class:`RankExecutor`, :class:`Updater` (:mod:`.step`, :mod:`.execute`):
  the own loop's execution, gradient sync and optimizer update;
- :func:`load_latency_model` (:mod:`.startup`), :func:`resolve_kernel` (:mod:`.kernel`):
  latency start-up and per-device defaults, once for every front end;
- :class:`StepReport`, :class:`Balance` (:mod:`.summary`): what a step's records say, for every
  front end (``StepReport.to_log()``: metrics.jsonl, log_history, TensorBoard, report).

The stage types are in :mod:`.records`; ``docs/engine.md`` draws the data flow.
"""

# The settings a front end hands the engine (its user-facing configs), re-exported so that no
# front end imports the stages below the engine (tests/engine/test_layering.py).
from ..batching import OVERLONG, PlanConfig
from ..latency import LatencyModel
from ..tuning import DSTConfig
from .engine import StepEngine
from .execute import ExecutionConfig, RankExecutor
from .kernel import Kernel, add_block_size_argument, resolve_block_size, resolve_kernel
from .layers import LayerTimer, packed_attention
from .records import (
    LocalWork,
    MicroBatchResult,
    RankRecord,
    StepFeedback,
    StepPlan,
    TunedStep,
)
from .runtime import Runtime
from .startup import check_global_batch, load_latency_model, profile_length
from .step import NonFiniteLoss, StepRunner, UpdateConfig, Updater
from .summary import Balance, StepReport, StepResult, log_values

__all__ = [
    "OVERLONG",
    "Balance",
    "DSTConfig",
    "ExecutionConfig",
    "Kernel",
    "LatencyModel",
    "LayerTimer",
    "LocalWork",
    "MicroBatchResult",
    "NonFiniteLoss",
    "PlanConfig",
    "RankExecutor",
    "RankRecord",
    "Runtime",
    "StepEngine",
    "StepFeedback",
    "StepPlan",
    "StepReport",
    "StepResult",
    "StepRunner",
    "TunedStep",
    "UpdateConfig",
    "Updater",
    "add_block_size_argument",
    "check_global_batch",
    "load_latency_model",
    "log_values",
    "packed_attention",
    "profile_length",
    "resolve_block_size",
    "resolve_kernel",
]
